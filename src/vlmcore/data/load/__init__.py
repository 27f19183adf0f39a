"""Training batches: the batch itself (`batch`), the global row order (`order`), packs made
into rows (`rows`), the loader over packed datasets and blends (`loader`), packing in the loader
(`online`), and how well a stream is mixed (`mixing`)."""
