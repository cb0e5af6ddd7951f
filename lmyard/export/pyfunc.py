"""MLflow pyfunc model (models from code) around an exported Hugging Face folder: text in, text out.

Logged by lmyard.tracking.model_registry.log_hf_model with the folder as the
artifact `hf_model`. It imports only MLflow and `transformers` (with torch),
never lmyard, so anything with those can load it, whatever the model family
(GPT2LMHeadModel, LlamaForCausalLM: it reads only what every causal LM has):

    model = mlflow.pyfunc.load_model("models:/NAME@ALIAS")
    model.predict(["Exceptions are"], params={"max_new_tokens": 40})  # -> ["Exceptions are ..."]

Design notes: docs/export.md, `lmyard/export/pyfunc.py`.
"""

from __future__ import annotations

from typing import Any

import mlflow
from mlflow.pyfunc import PythonModel

DEFAULTS = {"max_new_tokens": 64, "temperature": 0.8, "top_k": 40, "seed": 0, "do_sample": True}


def _prompts(model_input) -> list[str]:
    if isinstance(model_input, str):
        return [model_input]
    if hasattr(model_input, "columns"):  # a pandas DataFrame
        column = "prompt" if "prompt" in model_input.columns else model_input.columns[0]
        return [str(x) for x in model_input[column]]
    if isinstance(model_input, dict):
        value = model_input.get("prompt")
        return [value] if isinstance(value, str) else [str(x) for x in value or []]
    return [str(x) for x in model_input]


class HFTextGeneration(PythonModel):
    def load_context(self, context) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = context.artifacts["hf_model"]
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path).eval()

    def predict(self, context, model_input: list[str], params: dict[str, Any] | None = None) -> list[str]:
        import torch

        p = {**DEFAULTS, **{k: v for k, v in (params or {}).items() if v is not None}}
        eos = self.tokenizer.eos_token_id
        out = []
        for prompt in _prompts(model_input):
            torch.manual_seed(int(p["seed"]))
            n_ctx = self.model.config.max_position_embeddings  # every family's name for it (GPT-2: n_positions)
            # a long prompt keeps its end (verbose=False: the tokenizer would warn of its length, cut here)
            ids = torch.tensor([[eos, *self.tokenizer.encode(prompt, verbose=False)][-(n_ctx - 1) :]])
            room = max(0, min(int(p["max_new_tokens"]), n_ctx - ids.size(1)))
            with torch.no_grad():
                gen = self.model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=room,
                    do_sample=bool(p["do_sample"]),
                    temperature=float(p["temperature"]),
                    top_k=int(p["top_k"]),
                    pad_token_id=eos,
                )
            new = gen[0, ids.size(1) :].tolist()
            out.append(prompt + str(self.tokenizer.decode(new[: new.index(eos)] if eos in new else new)))
        return out


mlflow.models.set_model(HFTextGeneration())
