"""The demo's synthetic data: coloured shapes in images (`image`) and in clips (`video`), drawn
with the shared palette (`shapes`), written in one layout (`dataset`); `command` is `vlmcore synth`."""
