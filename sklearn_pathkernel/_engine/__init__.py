"""_engine"""
