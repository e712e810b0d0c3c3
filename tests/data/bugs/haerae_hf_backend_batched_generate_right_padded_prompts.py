# HAE-RAE/haerae-evaluation-toolkit commit aaf7af0 ("bugfix: batch_size and padding-left issue", PR #98, fixes
# #97), llm_eval/models/huggingface_backend.py HuggingFaceModel. The evaluator's HuggingFace backend loads the
# tokenizer with AutoTokenizer.from_pretrained(model_name_or_path) and generate_batch tokenizes each chunk of
# prompts with padding=True, then calls model.generate(**encoded). Once batch_size > 1 reached the backend (the
# other half of the same commit), prompts of different lengths were padded on the tokenizer's default side, the
# right, so a shorter prompt's generation continued after its pad tokens. Fix: load the tokenizer with
# padding_side='left'. (Both versions slice the generated part at the row's unpadded length, as the backend
# did then and still does, so under left padding a shorter row's prediction starts with the tail of its prompt.)
import logging
import string
import sys
import tempfile
from typing import Any, Dict, List, Optional, Union

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
logging.getLogger("transformers").setLevel(logging.ERROR)
logger = logging.getLogger("huggingface")


class BaseModel:
    def __init__(self, cot_trigger: Optional[str] = None, cot_parser=None, **kwargs):
        self.cot_trigger = cot_trigger
        self.cot_parser = cot_parser


class HuggingFaceModel(BaseModel):
    def __init__(
        self,
        model_name_or_path: str,
        device: str = "cpu",
        max_new_tokens: int = 128,
        temperature: float = 1.0,
        top_p: float = 0.95,
        do_sample: bool = True,
        batch_size: int = 1,
        **kwargs
    ):
        super().__init__(**kwargs)
        logger.info(f"Loading tokenizer/model from {model_name_or_path}")

        # Load tokenizer and model
        if FIXED:
            self.tokenizer = AutoTokenizer.from_pretrained(model_name_or_path, padding_side='left')
        else:
            self.tokenizer = AutoTokenizer.from_pretrained(model_name_or_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_name_or_path)
        self.model.eval()

        # Device setup
        self.device = device
        if self.device != "cpu":
            self.model.to(self.device)

        # Inference hyperparameters
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.do_sample = do_sample
        self.batch_size = batch_size

    def generate_batch(
        self,
        inputs: List[Dict[str, Any]],
        return_logits: bool = True,
        cot: bool = False,
        batch_size: Optional[Union[int, str]] = None,  # auto
        until: Optional[Union[str, List[str]]] = None,
        **kwargs
    ) -> List[Dict[str, Any]]:
        # Determine initial batch size
        if batch_size is None:
            batch_size = self.batch_size
        current_bs = batch_size if batch_size is not None else len(inputs)

        results = []
        # Process in chunks
        for start in range(0, len(inputs), current_bs):
            batch_items = inputs[start:start + current_bs]

            # Build prompts
            prompts = [
                f"{item['input']}\n{self.cot_trigger}\n" if (cot and self.cot_trigger) else item["input"]
                for item in batch_items
            ]

            # Tokenize (with padding/truncation)
            encoded = self.tokenizer(
                prompts,
                return_tensors="pt",
                padding=True,
                truncation=True
            )
            # Compute input lengths
            input_lens = encoded["attention_mask"].sum(dim=1).tolist()

            # Generation arguments
            gen_kwargs = {
                "max_new_tokens": self.max_new_tokens,
                "temperature": self.temperature,
                "top_p": self.top_p,
                "do_sample": self.do_sample,
            }
            if return_logits:
                gen_kwargs.update({
                    "return_dict_in_generate": True,
                    "output_scores": True,
                })

            # Generate
            with torch.no_grad():
                outputs = self.model.generate(**encoded, **gen_kwargs)

            if return_logits and isinstance(outputs, dict):
                sequences = outputs["sequences"]
                scores_list = outputs["scores"]  # a list of (batch_size, vocab_size) tensors
            else:
                sequences = outputs
                scores_list = None

            # Process each sample in the batch
            batch_size_actual = sequences.shape[0]
            for i in range(batch_size_actual):
                item = batch_items[i]
                input_len = input_lens[i]
                gen_ids = sequences[i][input_len:]  # Extract generated portion
                generated_text = self.tokenizer.decode(gen_ids, skip_special_tokens=True)

                final_answer = generated_text
                item["prediction"] = final_answer

                # Compute log probabilities if 'scores_list' is available
                if return_logits and scores_list is not None:
                    log_probs_per_token = []
                    sum_log_prob = 0.0
                    token_ids = gen_ids.tolist()
                    for t, step_scores in enumerate(scores_list):
                        if t >= len(token_ids):
                            break
                        step_score = step_scores[i]  # shape (vocab_size,)
                        step_log_probs = F.log_softmax(step_score, dim=-1)
                        token_log_prob = step_log_probs[token_ids[t]].item()
                        sum_log_prob += token_log_prob
                        log_probs_per_token.append(token_log_prob)

                    item["logits"] = {
                        "sum_log_prob": sum_log_prob,
                        "token_log_probs": log_probs_per_token,
                        "tokens": self.tokenizer.convert_ids_to_tokens(token_ids),
                    }

                results.append(item)

        return results


# A tiny Qwen2 checkpoint and a character-level Qwen2Tokenizer written to a local folder stand in for
# "Qwen/Qwen2.5-0.5B-Instruct" (the model of issue #97).
chars = list(string.ascii_lowercase) + ["Ġ", "?", ".", ":"]
vocab = {"<|endoftext|>": 0}
for ch in chars:
    vocab[ch] = len(vocab)
tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, bos_token=None,
                           pad_token="<|endoftext|>", eos_token="<|endoftext|>")
config = Qwen2Config(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                     pad_token_id=0, eos_token_id=0, bos_token_id=0, attn_implementation="sdpa")
ckpt = tempfile.mkdtemp()
Qwen2ForCausalLM(config).save_pretrained(ckpt)
tokenizer.save_pretrained(ckpt)

model = HuggingFaceModel(ckpt, max_new_tokens=6, do_sample=False, temperature=1.0, top_p=1.0, batch_size=4)
inputs = [
    {"input": "question: which city is the capital of korea? answer:", "reference": "seoul"},
    {"input": "q: two plus two? a:", "reference": "four"},
    {"input": "question: what color is the sky? answer:", "reference": "blue"},
    {"input": "q: opposite of hot? a:", "reference": "cold"},
]
results = model.generate_batch(inputs, return_logits=True)
for r in results:
    print(f"{r['prediction']!r:40s} sum_log_prob={r['logits']['sum_log_prob']:.4f}")
