"""_estimators"""
