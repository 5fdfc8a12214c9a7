"""Causal LMs and their tokenizers: any Hugging Face model by id or path, and the project's own tiny ones.

No model hub is reachable on CI or the GPU machine, so `make_tiny_model` builds a small
Qwen3-architecture model with random weights and a byte-level BPE tokenizer trained here, on the
project's own text as pinned in training/tokenizer_corpus.jsonl.gz (the same tokenizer on every commit
and every machine), with the chat template of training.chat_template.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training.chat_template import CHAT_TEMPLATE, IM_END, SPECIAL_TOKENS


@dataclass
class ModelSpec:
    """How to load a model for training or serving."""

    name_or_path: str
    dtype: str = "auto"  # auto: bf16 where the device supports it, else fp32
    device: str | None = None  # None: cuda if visible, else cpu
    gradient_checkpointing: bool = False
    lora_r: int = 0  # 0: full fine-tuning
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                             "gate_proj", "up_proj", "down_proj"])


def pick_device(device: str | None = None) -> str:
    import torch

    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def pick_dtype(dtype: str, device: str) -> Any:
    import torch

    if dtype == "auto":
        if device.startswith("cuda") and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    return {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
            "fp32": torch.float32, "float32": torch.float32}[dtype]


def load_tokenizer(name_or_path: str) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(name_or_path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(spec: ModelSpec) -> tuple[Any, Any]:
    """(model, tokenizer), the model on its device in eval mode; LoRA adapters attached if asked."""
    from transformers import AutoModelForCausalLM

    device = pick_device(spec.device)
    model = AutoModelForCausalLM.from_pretrained(spec.name_or_path, dtype=pick_dtype(spec.dtype, device))
    model.to(device)
    if spec.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    if spec.lora_r > 0:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=spec.lora_r, lora_alpha=spec.lora_alpha,
                                                 lora_dropout=spec.lora_dropout, target_modules=spec.lora_targets,
                                                 task_type="CAUSAL_LM"))
    model.eval()
    return model, load_tokenizer(spec.name_or_path)


def train_tokenizer(vocab_size: int, files: list[Path] | None = None, max_bytes: int = 8_000_000) -> Any:
    """A byte-level BPE tokenizer (the `tokenizers` library) as a PreTrainedTokenizerFast with the
    project's chat template, trained on the pinned corpus (training.tokenizer_corpus) or on `files`;
    every byte is in the vocabulary, so any text round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from training.tokenizer_corpus import corpus_texts

    texts: list[str] = []
    size = 0
    for text in corpus_texts() if files is None else (p.read_text(errors="replace") for p in files):
        texts.append(text)
        size += len(text)
        if size > max_bytes:
            break
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=IM_END, pad_token="<|endoftext|>",
                                  additional_special_tokens=SPECIAL_TOKENS[3:])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_tiny_model(out: Path, layers: int = 2, hidden: int = 64, vocab: int = 2048, heads: int = 4,
                    kv_heads: int = 2, intermediate: int | None = None, max_positions: int = 32768,
                    seed: int = 0) -> Path:
    """Writes a random-weight Qwen3 model and its tokenizer to `out` (loadable by from_pretrained)."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    tok = train_tokenizer(vocab)
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate or hidden * 3,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=hidden // heads, max_position_embeddings=max_positions, tie_word_embeddings=True,
                         bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def count_parameters(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())
