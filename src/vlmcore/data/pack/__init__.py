"""`vlmcore pack`: a prepared dataset -> a packed dataset of fixed-budget rows. The samples are
measured (`measure`), packed by best fit (`bin_packing`) into a plan (`plan`), and the packs
written (`writer`) in the packed format (`format`); `dataset` runs the steps, `command` is the CLI."""
