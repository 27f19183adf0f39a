# Compute nodes have no internet: every model, tokenizer and dataset is read from local paths.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline
