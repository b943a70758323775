"""The pipeline's stages, one module each (one-to-one with tasks/), and what they hand each other."""
