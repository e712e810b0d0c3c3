"""A mask split across context-parallel ranks: which rank holds which tokens (layouts), each rank's work and
ring steps (work), and the rules that say a split is wrong or imbalanced (checks).

A layout is a token -> rank assignment kept as pieces (runs of consecutive positions, in each rank's local
order), never a list per token, so that 1M tokens over 64 ranks is a few thousand numbers.
"""
