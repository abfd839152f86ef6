"""Build the lab's tiny random-weight Llama and its byte-level BPE tokenizer, once.

Why: no model hub can be reached here, and the lab needs a real model directory that
`vllm serve` loads like any Hugging Face checkpoint (config.json, safetensors,
tokenizer.json, a chat template). Random weights are fine for what the lab measures:
KV-cache handoff, latency, scheduling and fault handling do not depend on what the
tokens mean, and greedy decoding of fixed weights is still deterministic.

The tokenizer is trained with the `tokenizers` library on Python's own stdlib sources
(present on every machine), so the build needs no download. Runs inside the lab venv
(it needs transformers): `python -m kvbench.lab.venv.tinymodel OUT_DIR [--hidden ...]`.
"""

from __future__ import annotations

import hashlib
import json
import sys
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

from kvbench.lab.venv.args import OneLineParser, number

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
SPECIAL = ("<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>")


@dataclass(frozen=True)
class TinyModelSpec:
    """Geometry of the random model; the cache key is a hash of it (change it, get a new model)."""

    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 512
    vocab: int = 4096
    max_positions: int = 2048
    seed: int = 0

    def key(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:10]

    def kv_bytes_per_token(self, bytes_per_element: int = 2) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x dtype bytes: what decode pulls per token."""
        return 2 * self.layers * self.kv_heads * (self.hidden // self.heads) * bytes_per_element


def _corpus_files(limit: int = 400) -> list[str]:
    """Stdlib .py files in a fixed order: a deterministic training corpus on any machine."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [str(p) for p in sorted(root.glob("*.py"))[:limit]]


def build_tokenizer(out: Path, vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(SPECIAL),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(_corpus_files(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def build_model(out: Path, spec: TinyModelSpec, tokenizer) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(spec.seed)
    config = LlamaConfig(
        hidden_size=spec.hidden, num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads, intermediate_size=spec.intermediate,
        vocab_size=spec.vocab, max_position_embeddings=spec.max_positions,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, torch_dtype="bfloat16", tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def build(out: Path, spec: TinyModelSpec) -> Path:
    """Write model + tokenizer into out (a fresh folder), then a stamp that marks it complete."""
    out.mkdir(parents=True, exist_ok=False)
    tokenizer = build_tokenizer(out, spec.vocab)
    if len(tokenizer) > spec.vocab:
        raise SystemExit(f"tokenizer has {len(tokenizer)} tokens > model vocab {spec.vocab}")
    build_model(out, spec, tokenizer)
    (out / "kvbench-tiny-model.json").write_text(json.dumps(
        {"spec": asdict(spec), "key": spec.key(), "tokenizer_vocab": len(tokenizer),
         "kv_bytes_per_token_bf16": spec.kv_bytes_per_token(2),
         "corpus": "Python stdlib *.py (first 400 by name)"}, indent=2) + "\n")
    return out


SPEC_BOUNDS = {name: (1, 1 << 20) for name in asdict(TinyModelSpec())} | {"seed": (0, (1 << 32) - 1)}
"""Each spec field's accepted range; seed 0 (the default) is a seed like any other."""


def parser() -> OneLineParser:
    """The module's command line; the lab calls it through `spec_flags` (a test holds the two)."""
    p = OneLineParser(prog="python -m kvbench.lab.venv.tinymodel")
    p.add_argument("out")
    for name, value in asdict(TinyModelSpec()).items():
        lo, hi = SPEC_BOUNDS[name]
        p.add_argument(f"--{name.replace('_', '-')}", type=number(int, lo, hi), default=value)
    return p


def spec_flags(spec: TinyModelSpec) -> list[str]:
    """The flags that rebuild `spec` on this module's command line."""
    return [f"--{k.replace('_', '-')}={v}" for k, v in asdict(spec).items()]


def main(argv: list[str] | None = None) -> int:
    args = vars(parser().parse_args(argv))
    out = Path(args.pop("out"))
    build(out, TinyModelSpec(**args))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())


def model_dir(spec: TinyModelSpec, home: Path) -> Path:
    return home / "models" / f"tiny-llama-{spec.key()}"


def ensure_model(spec: TinyModelSpec, home: Path, python: Path, repo_root: Path) -> Path:
    """Build the model once into the cache (in the lab venv, via a temp folder + rename)."""
    import os
    import shutil
    import subprocess

    out = model_dir(spec, home)
    if (out / "kvbench-tiny-model.json").exists():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    import sys
    import time

    print(f"lab: building the tiny model (first use: no {out.name} in {out.parent}) ...",
          file=sys.stderr, flush=True)
    t0 = time.monotonic()
    env = dict(os.environ, PYTHONPATH=str(repo_root), HF_HUB_OFFLINE="1")
    subprocess.run([str(python), "-m", "kvbench.lab.venv.tinymodel", str(tmp), *spec_flags(spec)],
                   check=True, env=env, stdout=subprocess.DEVNULL)
    tmp.rename(out)
    print(f"lab: built {out} in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    return out
