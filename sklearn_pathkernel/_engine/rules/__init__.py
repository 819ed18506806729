"""_engine/rules"""
