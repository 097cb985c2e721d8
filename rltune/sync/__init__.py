"""Sparse delta weight sync: publish only the elements an optimizer step changed, between anchors.

See docs/delta-format.md for the byte format. ``kernels.reference`` holds the torch reference of
every element operation; the Triton kernels beside it are compared with it bit for bit.
"""
