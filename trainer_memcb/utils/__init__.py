"""The bottom layer: byte units and reading and writing files without trusting them.

Imports nothing else from the package.
"""
