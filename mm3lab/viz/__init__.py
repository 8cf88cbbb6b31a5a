"""Pictures of MSA's data structures: every function returns a matplotlib Figure.

One module per topic (``layout``, ``causal_tail``, ``selection``, ``msa``,
``performance``); notebooks call them, tests check what they draw.
"""
