"""Data: synthetic demo data, preparation, tokenization, packing and loading."""

# Label of the tokens that carry no loss (torch cross_entropy's default ignore_index).
IGNORE_INDEX = -100
