"""Statistics fitted on a dataset's train split (scaling, vocabularies, the label's transform,
tokenizers, pixels), the transform that applies them, and drift against them."""
