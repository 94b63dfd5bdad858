"""Byte-level BPE tokenizer and chat templates, built from a GGUF file or a Hugging Face directory.

The GGUF path rebuilds the tokenizer from `tokenizer.ggml.tokens` / `merges` / `token_type` with the
`tokenizers` library. For SmolLM2 (`tokenizer.ggml.pre == "smollm"`) digits are split one by one
*before* the byte-level step, as SmolLM2's own tokenizer.json and llama.cpp do; transformers' GGUF
conversion drops that step and tokenises e.g. " 2007" differently. Chat templates are rendered the
way transformers renders them (sandboxed jinja2, trim_blocks + lstrip_blocks, `raise_exception`,
`strftime_now`, a `tojson` that keeps non-ASCII), so `encode(apply_chat_template(m))` reproduces
transformers' `apply_chat_template(m, tokenize=True)` token for token.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

# Special tokens that end a turn or a document in Llama-family chat models; any that the
# vocabulary marks special join the tokenizer's eos token in `eos_ids`.
_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|endoftext|>", "</s>")

# Llama-3's pre-tokenizer regex (tokenizer.json of Meta-Llama-3*, llama.cpp's "llama-bpe").
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# GGUF token_type values (llama.cpp `llama_token_type`).
_GGUF_CONTROL = 3
_GGUF_USER_DEFINED = 4


def _pre_tokenizer_for(pre: str, path: Path) -> pre_tokenizers.PreTokenizer:
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
  if pre in ("smollm", "default", ""):
    # SmolLM2's tokenizer.json: Sequence[Digits(individual), ByteLevel(use_regex=True)].
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
  if pre == "gpt2":
    return byte_level
  if pre in ("llama-bpe", "llama3"):
    split = pre_tokenizers.Split(tokenizers.Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False)
    return pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
  raise ValueError(
      f"{path}: unsupported tokenizer.ggml.pre {pre!r}; supported: 'smollm', 'gpt2', 'llama-bpe'."
  )


class _GenerationTag(jinja2.ext.Extension):
  """Accepts transformers' `{% generation %}...{% endgeneration %}` and renders its body as is."""

  tags = {"generation"}

  def parse(self, parser):
    next(parser.stream)
    return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
  return datetime.datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
  )
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  return env.from_string(source)


class Tokenizer:
  """A `tokenizers.Tokenizer` plus the special ids and chat template a generator needs.

  Attributes:
    bos_id: beginning-of-sequence id, or None.
    eos_ids: eos id first, then every special end-of-turn/end-of-text token the vocabulary has.
    stop_ids: frozenset(eos_ids), for membership tests in the decode loop.
    pad_id: padding id, or None.
    chat_template: the jinja source, or None.
  """

  def __init__(
      self,
      tok: tokenizers.Tokenizer,
      *,
      bos_token: str | None,
      eos_token: str | None,
      chat_template: str | None = None,
      pad_token: str | None = None,
      extra_eos_ids: Iterable[int] = (),
  ):
    self._tok = tok
    self.bos_token = bos_token
    self.eos_token = eos_token
    self.pad_token = pad_token
    self.bos_id = tok.token_to_id(bos_token) if bos_token is not None else None
    self.pad_id = tok.token_to_id(pad_token) if pad_token is not None else None
    eos_id = tok.token_to_id(eos_token) if eos_token is not None else None
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    ids = [eos_id] + list(extra_eos_ids) + [tok.token_to_id(t) for t in _END_TOKENS if t in special]
    self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in ids if i is not None))
    self.stop_ids: frozenset[int] = frozenset(self.eos_ids)
    self.chat_template = chat_template
    self._template = _compile_template(chat_template) if chat_template else None

  # ---- construction -------------------------------------------------------------------------

  @classmethod
  def from_gguf(cls, path: str | os.PathLike | Any) -> Tokenizer:
    """Builds the tokenizer stored in a GGUF file (llama.cpp `gpt2`-model byte-level BPE).

    Args:
      path: the .gguf file, or an already open `gguf.GGUFReader` (parsing the header of a
        GGUF takes seconds, so a caller that also loads the weights can share its reader).
    """
    import gguf  # deferred: only this constructor needs it

    if isinstance(path, gguf.GGUFReader):
      reader, path = path, Path(getattr(path.data, "filename", None) or "<GGUFReader>")
    else:
      path = Path(path)
      if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
      try:
        reader = gguf.GGUFReader(str(path))
      except Exception as e:  # gguf raises ValueError, struct/numpy errors on corrupt input
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e

    def field(name: str, default: Any = None) -> Any:
      f = reader.fields.get(name)
      return default if f is None else f.contents()

    tokens = field("tokenizer.ggml.tokens")
    merges = field("tokenizer.ggml.merges")
    if not tokens or merges is None:
      raise ValueError(f"{path} has no tokenizer.ggml.tokens / tokenizer.ggml.merges metadata.")
    kind = field("tokenizer.ggml.model", "gpt2")
    if kind != "gpt2":
      raise ValueError(f"{path}: tokenizer.ggml.model {kind!r} is not supported "
                       "(only byte-level BPE, 'gpt2').")
    pre = field("tokenizer.ggml.pre", "default")
    token_type = field("tokenizer.ggml.token_type") or [1] * len(tokens)

    def token_at(key: str) -> str | None:
      i = field(key)
      return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=[tuple(m.split(" ", 1)) for m in merges],
        unk_token=token_at("tokenizer.ggml.unknown_token_id"),
        fuse_unk=False,
        byte_fallback=False,
        ignore_merges=pre in ("llama-bpe", "llama3"),
    )
    tok = tokenizers.Tokenizer(bpe)
    tok.pre_tokenizer = _pre_tokenizer_for(pre, path)
    tok.decoder = decoders.ByteLevel()
    added = [
        tokenizers.AddedToken(t, special=(tt == _GGUF_CONTROL), normalized=False)
        for t, tt in zip(tokens, token_type)
        if tt in (_GGUF_CONTROL, _GGUF_USER_DEFINED)
    ]
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])

    bos = token_at("tokenizer.ggml.bos_token_id")
    if bos is not None and field("tokenizer.ggml.add_bos_token", False):
      tok.post_processor = processors.TemplateProcessing(
          single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))]
      )
    else:
      tok.post_processor = processors.ByteLevel(trim_offsets=False)
    extra = [field(k) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")]
    return cls(
        tok,
        bos_token=bos,
        eos_token=token_at("tokenizer.ggml.eos_token_id"),
        pad_token=token_at("tokenizer.ggml.padding_token_id"),
        chat_template=field("tokenizer.chat_template"),
        extra_eos_ids=[int(i) for i in extra if i is not None],
    )

  @classmethod
  def from_hf_dir(cls, path: str | os.PathLike) -> Tokenizer:
    """Loads tokenizer.json plus, where present, tokenizer_config.json, special_tokens_map.json,
    chat_template.jinja and generation_config.json (whose eos_token_id list joins `eos_ids`)."""
    path = Path(path)
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
      raise FileNotFoundError(f"tokenizer.json not found in {path}")
    try:
      tok = tokenizers.Tokenizer.from_file(str(tok_file))
    except Exception as e:
      raise ValueError(f"{tok_file} is not a valid tokenizers JSON file: {e}") from e

    def read_json(name: str) -> dict:
      f = path / name
      if not f.is_file():
        return {}
      try:
        return json.loads(f.read_text(encoding="utf-8"))
      except json.JSONDecodeError as e:
        raise ValueError(f"{f} is not valid JSON: {e}") from e

    config = read_json("tokenizer_config.json")
    special_map = read_json("special_tokens_map.json")

    def token(name: str) -> str | None:
      t = config.get(name, special_map.get(name))
      return t.get("content") if isinstance(t, dict) else t

    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
      named = {t["name"]: t["template"] for t in template}
      template = named.get("default", next(iter(named.values()), None))
    if (path / "chat_template.jinja").is_file():
      template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    gen_eos = read_json("generation_config.json").get("eos_token_id", [])
    return cls(
        tok,
        bos_token=token("bos_token"),
        eos_token=token("eos_token"),
        pad_token=token("pad_token"),
        chat_template=template,
        extra_eos_ids=[gen_eos] if isinstance(gen_eos, int) else gen_eos,
    )

  def save(self, path: str | os.PathLike) -> None:
    """Writes tokenizer.json + tokenizer_config.json that `from_hf_dir` reads back."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    self._tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": self.bos_token, "eos_token": self.eos_token,
              "pad_token": self.pad_token, "chat_template": self.chat_template}
    (path / "tokenizer_config.json").write_text(
        json.dumps({k: v for k, v in config.items() if v is not None}, indent=1) + "\n")
    extra = [i for i in self.eos_ids if i != self.token_to_id(self.eos_token or "")]
    if extra:
      (path / "generation_config.json").write_text(json.dumps({"eos_token_id": extra}) + "\n")

  # ---- use ----------------------------------------------------------------------------------

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  @property
  def backend(self) -> tokenizers.Tokenizer:
    """The underlying `tokenizers.Tokenizer` (e.g. to `.save()` it as tokenizer.json)."""
    return self._tok

  def token_to_id(self, token: str) -> int | None:
    return self._tok.token_to_id(token)

  def id_to_token(self, token_id: int) -> str | None:
    return self._tok.id_to_token(int(token_id))

  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    """Text -> ids. Special tokens written in `text` (e.g. "<|im_start|>") map to their ids."""
    return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def apply_chat_template(
      self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
  ) -> str:
    """Renders `messages` ([{"role": ..., "content": ...}]) to the prompt string."""
    if self._template is None:
      raise ValueError("this tokenizer has no chat template; pass a plain prompt instead.")
    specials = dict(bos_token=self.bos_token, eos_token=self.eos_token, pad_token=self.pad_token)
    return self._template.render(
        messages=messages, add_generation_prompt=add_generation_prompt, **specials, **kwargs
    )

  def stream_decoder(self, skip_special_tokens: bool = False) -> StreamDecoder:
    return StreamDecoder(self, skip_special_tokens=skip_special_tokens)


class StreamDecoder:
  """Turns ids arriving one at a time into printable text increments.

  A character split across tokens (multi-byte UTF-8 under byte-level BPE) is held back until its
  last byte arrives, so `"".join(push(i) for i in ids) + flush() == tokenizer.decode(ids)`.
  """

  def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
    self._tokenizer = tokenizer
    self._skip = skip_special_tokens
    self._ids: list[int] = []
    self._read = 0  # ids[:_read] have been emitted; ids[_read:] are pending

  def _decode(self, ids: list[int]) -> str:
    return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

  def push(self, token_id: int) -> str:
    """Adds one id; returns the newly completed text ("" while a character is incomplete)."""
    self._ids.append(int(token_id))
    # Decode with the previous emitted span as context so decoders that look at neighbours
    # (e.g. SentencePiece's leading-space rule) see the same text as a full decode would.
    prefix = self._decode(self._ids[: self._read])
    text = self._decode(self._ids)
    if len(text) > len(prefix) and not text.endswith("\ufffd"):
      # Keep only the span just emitted as context for the next call.
      del self._ids[: self._read]
      self._read = len(self._ids)
      return text[len(prefix):]
    return ""

  def flush(self) -> str:
    """Returns whatever is still pending (an incomplete character decodes to U+FFFD)."""
    prefix = self._decode(self._ids[: self._read])
    text = self._decode(self._ids)
    self._ids, self._read = [], 0
    return text[len(prefix):]
