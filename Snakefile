# vlmcore: download -> prepare -> pack -> train stages -> export -> evaluate -> scaling report.
# Run: snakemake --profile profiles/local train_all   (see README.md for partial reruns)
from snakemake.utils import min_version

min_version("9.20")


configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/download.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/export.smk"
include: "workflow/rules/eval.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/targets.smk"
