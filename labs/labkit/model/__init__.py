"""The course's model, plain PyTorch with no parallelism in it.

  transformer  a small GPT-style transformer whose every tensor can be counted: its
               shape, blocks, embedding and head, a random batch, the next-token loss
  moe          a mixture-of-experts feed-forward block and the transformer that uses it

Imports torch, labkit.runtime and labkit.predict; how the model is split over ranks lives
in labkit.parallel.
"""
