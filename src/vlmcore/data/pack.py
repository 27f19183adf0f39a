"""`vlmcore pack`: a prepared dataset -> a packed Energon dataset of fixed-budget sequences.

Pass 1 reads every sample, decodes its images in full (a file truncated after its header is
counted as bad here, never met by the loader), measures it with the model's processor (token
count after image-token expansion, image patches from the image size) and applies the overlong
policy. The samples are then packed by best fit decreasing under `seq_len` tokens and
`max_patches` image patches. Pass 2 copies each pack's samples into one webdataset sample
(`json` = the segments, plus the images), read back from the input shards by offset, so memory
holds only the per-sample sizes. Tokenization happens again in the loader (crude samples).

The packed dataset carries a copy of the model's tokenizer/processor files under `model/`, so
the loader encodes exactly as measured here. stats.json reports efficiency, drops and truncations.
Everything is written into `<out>.partial` and renamed to `<out>` at the end, so a killed pack
never leaves a directory that looks finished.
"""

import argparse
import json
import logging
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import webdataset
from PIL import Image
from tqdm import tqdm

from vlmcore.data.encoder import IGNORE_INDEX, EncodingError, SampleEncoder, TextEncoding
from vlmcore.data.packing import best_fit_decreasing, packing_stats
from vlmcore.data.quality import BadDataLog, BadSample, TooMuchBadData, check_image, decode_utf8
from vlmcore.data.shards import Part, energon_prepare, iter_shard_samples, shard_paths

logger = logging.getLogger(__name__)

MODEL_FILES = [
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
]
PACK_MODEL_DIR = "model"


@dataclass
class Measured:
    shard: Path
    key: str
    sample: dict
    image_sizes: list[tuple[int, int]]  # all images, also those cut off by truncation
    images: list[Part]  # the images that are kept
    image_exts: list[str]
    num_tokens: int
    num_patches: int


def measure_sample(sample: dict, parts: dict, encoder: SampleEncoder, seq_len: int, max_patches: int,
                   overlong: str, counts: dict) -> tuple[TextEncoding, list[str], list[tuple[int, int]]]:
    """Encode the text of one stored sample as the loader will, and apply the overlong policy.

    Returns the encoding, the names of the image parts it keeps, and the sizes of all its images.
    Raises BadSample or EncodingError for samples to skip.
    """
    names = sample.get("images", [])
    sizes = []
    for name in names:
        if name not in parts:
            raise BadSample("missing_image", f"part {name}")
        try:
            sizes.append(check_image(parts[name], Image.MAX_IMAGE_PIXELS)[2])  # decodes every pixel
        except BadSample as e:
            raise BadSample(e.reason, f"{name}: {e.detail}") from e
    enc = encoder.encode_text(sample, sizes)
    if enc.num_patches > max_patches:
        counts["dropped_overlong"] += 1
        raise BadSample("too_many_patches", f"{enc.num_patches} patches > max_patches {max_patches}")
    if len(enc.input_ids) > seq_len:
        if overlong == "drop":
            counts["dropped_overlong"] += 1
            raise BadSample("overlong", f"{len(enc.input_ids)} tokens > seq_len {seq_len}")
        enc = encoder.truncate(enc, encoder.truncation_point(enc.input_ids, seq_len))
        if all(label == IGNORE_INDEX for label in enc.labels):
            raise BadSample("no_labels", f"nothing left to train on after truncation to {seq_len} tokens")
        counts["truncated"] += 1
    if all(label == IGNORE_INDEX for label in enc.labels):
        raise BadSample("no_labels", "nothing to train on")
    return enc, names[: len(enc.image_grid_thw)], sizes


def measure(shard_sample, encoder: SampleEncoder, seq_len: int, max_patches: int, overlong: str, counts: dict) -> Measured:
    """Size one shard sample as the loader will encode it; raises BadSample/EncodingError to skip it."""
    if shard_sample.unsafe_names:
        raise BadSample("unsafe_tar_member", repr(shard_sample.unsafe_names[0]))
    if "json" not in shard_sample.data:
        raise BadSample("malformed_row", f"no json part, parts {sorted(shard_sample.parts)}")
    try:
        sample = json.loads(decode_utf8(shard_sample.data["json"]))
    except json.JSONDecodeError as e:
        raise BadSample("malformed_json", str(e)) from e
    enc, kept, sizes = measure_sample(sample, shard_sample.data, encoder, seq_len, max_patches, overlong, counts)
    return Measured(
        shard=shard_sample.shard,
        key=shard_sample.key,
        sample={k: v for k, v in sample.items() if k != "images"},
        image_sizes=sizes,
        images=[shard_sample.parts[n] for n in kept],
        image_exts=[n.rsplit(".", 1)[-1] for n in kept],
        num_tokens=len(enc.input_ids),
        num_patches=enc.num_patches,
    )


def write_packs(out_dir: Path, bins: list[list[int]], items: list[Measured], shard_size: int) -> None:
    open_shards = {}
    with webdataset.ShardWriter(str(out_dir / "shard-%06d.tar"), maxcount=shard_size, verbose=0) as writer:
        for pack_index, members in enumerate(tqdm(bins, desc="write packs", unit="pack")):
            record = {"__key__": f"{pack_index:09d}"}
            segments = []
            for s, i in enumerate(members):
                item = items[i]
                if item.shard not in open_shards:
                    open_shards[item.shard] = open(item.shard, "rb")
                f = open_shards[item.shard]
                names = []
                for k, (part, ext) in enumerate(zip(item.images, item.image_exts)):
                    f.seek(part.offset)
                    names.append(f"s{s}_img{k}.{ext}")
                    record[names[-1]] = f.read(part.size)
                segments.append(
                    {
                        "key": item.key,
                        "sample": item.sample,
                        "image_sizes": item.image_sizes,
                        "images": names,
                        "num_tokens": item.num_tokens,
                    }
                )
            record["json"] = json.dumps({"segments": segments}).encode()
            writer.write(record)
    for f in open_shards.values():
        f.close()


def copy_model_files(model_dir: Path, out_dir: Path) -> None:
    target = out_dir / PACK_MODEL_DIR
    target.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, target / name)


def pack(data_dir, model_dir, out_dir, seq_len: int, max_patches: int, overlong: str = "truncate",
         shard_size: int = 1000, seed: int = 0, max_bad_fraction: float = 0.05) -> dict:
    if overlong not in ("truncate", "drop"):
        raise ValueError(f"overlong must be 'truncate' or 'drop', got {overlong!r}")
    data_dir, model_dir, out_dir = Path(data_dir), Path(model_dir), Path(out_dir)
    encoder = SampleEncoder(model_dir)
    log = BadDataLog("pack", max_bad_fraction)
    counts = {"truncated": 0, "dropped_overlong": 0}
    items: list[Measured] = []
    for shard in shard_paths(data_dir):
        for shard_sample in tqdm(iter_shard_samples(shard), desc=f"measure {shard.name}", unit="sample"):
            log.seen += 1
            try:
                items.append(measure(shard_sample, encoder, seq_len, max_patches, overlong, counts))
            except (BadSample, EncodingError) as e:
                log.skip(e.reason, f"{shard.name}:{shard_sample.key}", str(e))

    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    tokens = [item.num_tokens for item in items]
    patches = [item.num_patches for item in items]
    bins = best_fit_decreasing(tokens, patches, seq_len, max_patches)
    # Packs leave BFD largest-first; shuffle so the stream does not start with all the long ones.
    random.Random(seed).shuffle(bins)
    stats = {
        "data": str(data_dir),
        "model": str(model_dir),
        "seq_len": seq_len,
        "max_patches": max_patches,
        "overlong": overlong,
        **packing_stats(bins, tokens, patches, seq_len, max_patches),
        **counts,
        "bad": log.as_dict(),
    }
    (partial / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    try:
        log.check()
        if not items:
            raise TooMuchBadData(f"pack: no usable samples in {data_dir}")
    except TooMuchBadData:
        replace_dir(partial, out_dir)  # only stats.json, to explain the failure: no reader takes it for a dataset
        raise
    write_packs(partial, bins, items, shard_size)
    copy_model_files(model_dir, partial)
    (partial / "pack_config.json").write_text(json.dumps({"seq_len": seq_len, "max_patches": max_patches}) + "\n")
    energon_prepare(partial)
    replace_dir(partial, out_dir)
    return stats


def replace_dir(new: Path, target: Path) -> None:
    """Rename `new` to `target`; an old `target` is moved aside first and deleted after."""
    old = target.with_name(target.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        target.rename(old)
    new.rename(target)
    shutil.rmtree(old, ignore_errors=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True, help="prepared Energon dataset (data/<dataset>)")
    parser.add_argument("--model", required=True, help="model snapshot directory (tokenizer, chat template, processor)")
    parser.add_argument("--out", required=True, help="output packed dataset directory (packed/<dataset>)")
    parser.add_argument("--seq-len", type=int, required=True, help="tokens per packed sequence")
    parser.add_argument("--max-patches", type=int, required=True, help="image patches per packed sequence (vision tower budget)")
    parser.add_argument("--overlong", choices=["truncate", "drop"], default="truncate", help="what to do with samples longer than --seq-len")
    parser.add_argument("--shard-size", type=int, default=1000, help="packs per tar shard")
    parser.add_argument("--seed", type=int, default=0, help="seed of the pack order")
    parser.add_argument("--max-bad-fraction", type=float, default=0.05, help="fail when more of the samples are bad")


def run(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        stats = pack(args.data, args.model, args.out, args.seq_len, args.max_patches, args.overlong,
                     args.shard_size, args.seed, args.max_bad_fraction)
    except TooMuchBadData as e:
        logger.error("%s (details in %s/stats.json)", e, args.out)
        return 1
    print(json.dumps({k: stats[k] for k in ("packs", "samples", "efficiency", "truncated", "dropped_overlong")}))
    return 0
