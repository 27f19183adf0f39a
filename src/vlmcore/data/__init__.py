"""Data, by stage: `synthetic` (the demo data), `prepare` (sources -> shards), `media` (images,
videos, tokenizer, sample encoding), `pack` (shards -> packed rows), `load` (packed rows ->
batches); `shards` (the webdataset shards every stage reads and writes) and `quality` (bad-sample
accounting) are shared by all of them."""

# Label of the tokens that carry no loss (torch cross_entropy's default ignore_index).
IGNORE_INDEX = -100
