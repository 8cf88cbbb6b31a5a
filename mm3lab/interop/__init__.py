"""Interop with other attention libraries: MSA selections in their formats (SPEC section 10)."""
