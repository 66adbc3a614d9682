"""Text <-> token ids and the chat template, backed by the ``tokenizers`` library.

Contract: ``TextTokenizer.load(dir)`` reads ``tokenizer.json`` and ``tokenizer_config.json`` (chat
template, special tokens) from a model directory; ``encode`` never adds special tokens by itself
(the chat template decides); ``chat_prompt`` renders messages with the model's Jinja template in a
sandbox. ``from_gguf_vocab`` builds the byte-level BPE tokenizer stored inside a GGUF file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers


class TextTokenizer:
    """A tokenizer plus the chat template and stop tokens of one model."""

    def __init__(self, tok: Tokenizer, config: dict[str, Any]) -> None:
        self.tok = tok
        self.config = config
        self._template = None
        if config.get("chat_template"):
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self._template = env.from_string(config["chat_template"])

    @classmethod
    def load(cls, model_dir: str | Path) -> TextTokenizer:
        model_dir = Path(model_dir)
        cfg_path = model_dir / "tokenizer_config.json"
        config = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.exists() else {}
        if not isinstance(config, dict):
            raise ValueError(f"{cfg_path} holds a JSON {type(config).__name__}, not an object")
        return cls(Tokenizer.from_file(str(model_dir / "tokenizer.json")), config)

    def save(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        self.tok.save(str(model_dir / "tokenizer.json"))
        (model_dir / "tokenizer_config.json").write_text(json.dumps(self.config, indent=1))

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        eos = self.config.get("eos_token")
        return self.tok.token_to_id(eos) if eos else None

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Tokens that end an assistant turn (eos and the template's end-of-turn)."""
        ids = {self.eos_token_id}
        for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
            ids.add(self.tok.token_to_id(name))
        return tuple(sorted(i for i in ids if i is not None))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def chat_prompt(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render a conversation with the model's chat template."""
        if self._template is None:
            raise ValueError("this tokenizer has no chat template; pass --no-chat-template")
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.config.get("bos_token", ""),
            eos_token=self.config.get("eos_token", ""),
        )

    def encode_chat(self, user_text: str, system: str | None = None) -> list[int]:
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": user_text})
        return self.encode(self.chat_prompt(messages))


def from_gguf_vocab(
    tokens: list[str],
    token_types: list[int],
    merges: list[str],
    special: dict[str, int | None],
    chat_template: str | None,
) -> TextTokenizer:
    """Byte-level BPE (GPT-2 style, digits split individually as SmolLM2's tokenizer does).

    token_types follow llama.cpp: 3 = control (added as special tokens).
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    control = [t for t, ty in zip(tokens, token_types, strict=True) if ty == 3]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])

    def name(key: str) -> str | None:
        idx = special.get(key)
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    config = {
        "bos_token": name("bos"),
        "eos_token": name("eos"),
        "pad_token": name("pad"),
        "unk_token": name("unk"),
        "chat_template": chat_template,
        "model_max_length": 8192,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    return TextTokenizer(tok, config)
