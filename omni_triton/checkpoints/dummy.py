"""Write a config-only checkpoint dir: everything the served stages read but the weights.

For ``load_format="dummy"`` (seeded random weights built on the device, ``omni_triton.models.weights``) the
preprocess and orchestrator stages still need a tokenizer, a chat template and a generation config. The dir
holds the source's config.json (optionally with the thinker and talker cut to N layers), its
generation_config.json, and the tiny checkpoint's byte-level BPE tokenizer renumbered into the config's
vocabulary so that every token the config names sits at exactly that id: ``<|im_start|>``, ``<|im_end|>``,
the audio/vision tokens, ``<tts_pad>``/``<tts_text_bos>``/``<tts_text_eod>``, the role words (single tokens, as
the talker finds turns by them) and the generation config's EOS/pad (``<|endoftext|>``). No weights file.

    python -m omni_triton.checkpoints.dummy --config qwen3_omni_30b_a3b [--layers 40] [--out DIR]
    omni-triton build dummy --config qwen3_omni_30b_a3b
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import tempfile
from pathlib import Path

from omni_triton.checkpoints.tokenizer import build_tokenizer, with_token_ids, write_tokenizer_files
from omni_triton.models.config import resolve_config_dir, write_config_with_layers

STAMP_FILE = "dummy_checkpoint.json"  # written last: a complete dir, and what it was built from
DEFAULT_ROOT = Path("checkpoints/dummy")
# token -> where a Qwen3-Omni config.json names its id (top-level keys, then the thinker's)
CONFIG_TOKEN_KEYS = {
    "<|im_start|>": "im_start_token_id", "<|im_end|>": "im_end_token_id",
    "<tts_pad>": "tts_pad_token_id", "<tts_text_bos>": "tts_bos_token_id", "<tts_text_eod>": "tts_eos_token_id",
    "system": "system_token_id", "user": "user_token_id", "assistant": "assistant_token_id",
    "<|audio_pad|>": "thinker_config.audio_token_id", "<|audio_start|>": "thinker_config.audio_start_token_id",
    "<|audio_end|>": "thinker_config.audio_end_token_id", "<|image_pad|>": "thinker_config.image_token_id",
    "<|video_pad|>": "thinker_config.video_token_id", "<|vision_start|>": "thinker_config.vision_start_token_id",
    "<|vision_end|>": "thinker_config.vision_end_token_id",
}
# generation_config.json's pad id, which the released one sets to <|endoftext|> (its second EOS)
PAD_TOKEN = "<|endoftext|>"


def config_token_ids(config: dict, generation: dict) -> dict[str, int]:
    """Token -> the id this config (and generation config) gives it, for every token it names. Raises
    ValueError where two names meet at one id, or where the talker's copy of an id differs from the thinker's."""
    ids: dict[str, int] = {}
    for token, key in CONFIG_TOKEN_KEYS.items():
        section, _, name = key.rpartition(".")
        value = (config.get(section) or {}).get(name) if section else config.get(name)
        if value is not None:
            ids[token] = int(value)
        talker_value = config.get("talker_config", {}).get(name) if section else None
        if talker_value is not None and value is not None and int(talker_value) != int(value):
            raise ValueError(f"config.json: talker_config.{name}={talker_value} but {key}={value}")
    if generation.get("pad_token_id") is not None:
        ids[PAD_TOKEN] = int(generation["pad_token_id"])
    by_id: dict[int, str] = {}
    for token, token_id in ids.items():
        if token_id in by_id:
            raise ValueError(f"config names id {token_id} for both {by_id[token_id]!r} and {token!r}")
        by_id[token_id] = token
    eos = generation.get("eos_token_id", [])
    unnamed = [i for i in (eos if isinstance(eos, list) else [eos]) if int(i) not in by_id]
    if unnamed:
        raise ValueError(f"generation_config eos_token_id {unnamed} is no token this builder knows "
                         f"(named ids: {sorted(by_id)})")
    return ids


def default_dir(source: str | Path, layers: int | None = None) -> Path:
    """Where ``omni-triton serve --config SOURCE [--dummy-layers N]`` keeps its dir."""
    name = Path(source).name or str(source)
    return DEFAULT_ROOT / (f"{name}-{layers}-layers" if layers else name)


def build(source: str | Path, out_dir: str | Path | None = None, layers: int | None = None, *,
          force: bool = False) -> Path:
    """The dummy checkpoint dir for ``source`` (a shipped config name or a dir with config.json), thinker and
    talker cut to at most ``layers`` layers; kept when already built from the same source files."""
    source_dir = resolve_config_dir(source)
    out_dir = Path(out_dir) if out_dir is not None else default_dir(source, layers)
    generation_path = source_dir / "generation_config.json"
    fingerprint = hashlib.sha256((source_dir / "config.json").read_bytes() + (
        generation_path.read_bytes() if generation_path.is_file() else b"")).hexdigest()
    stamp = {"source": str(source), "source_sha256": fingerprint, "layers": layers}
    stamp_path = out_dir / STAMP_FILE
    if not force and stamp_path.is_file() and json.loads(stamp_path.read_text()) == stamp:
        return out_dir
    config = json.loads((source_dir / "config.json").read_text())
    generation = json.loads(generation_path.read_text()) if generation_path.is_file() else {
        "eos_token_id": [int(config["im_end_token_id"])]}
    vocab_size = int(config["thinker_config"]["text_config"]["vocab_size"])
    tokenizer = with_token_ids(build_tokenizer(), config_token_ids(config, generation), vocab_size)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would keep a server run as another user (the compose service) out
    try:
        if layers:
            write_config_with_layers(source_dir, layers, staging)
        else:
            shutil.copyfile(source_dir / "config.json", staging / "config.json")
        (staging / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        write_tokenizer_files(tokenizer, staging)
        (staging / STAMP_FILE).write_text(json.dumps(stamp, indent=1) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def is_dummy_checkpoint(checkpoint_dir: str | Path) -> bool:
    return (Path(checkpoint_dir) / STAMP_FILE).is_file()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="qwen3_omni_30b_a3b",
                        help="a shipped config name or a dir with config.json (default: %(default)s)")
    parser.add_argument("--layers", type=int, help="cut thinker and talker to at most this many layers "
                                                   "(default: the config's)")
    parser.add_argument("--out", type=Path, help="output dir (default: checkpoints/dummy/<config>[-<N>-layers])")
    parser.add_argument("--force", action="store_true", help="rebuild even if the dir is up to date")
    args = parser.parse_args(argv)
    out = build(args.config, args.out, args.layers, force=args.force)
    print(f"dummy checkpoint dir (config + tokenizer, no weights) for {args.config} at {out}")


if __name__ == "__main__":
    main()
