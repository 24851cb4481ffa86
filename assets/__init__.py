"""Dagster assets by stage (thin wrappers over ``tokenmill``) and their checks.

``assets.factory.build_assets(recipe)`` turns a recipe into every asset and check.
"""
