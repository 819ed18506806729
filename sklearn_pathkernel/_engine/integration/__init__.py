"""_engine/integration"""
