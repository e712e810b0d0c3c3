# SkyworkAI/Skywork#55, fixed in commit 520daef (PR #65, "Fix attention bug in eval_loss.py"), eval/eval_loss.py.
# The loss-evaluation script tokenizes each batch of texts with padding_side = "right" and pad = eos, runs the
# model with that attention_mask and weights the per-token cross entropy of logits[:, :-1] against
# labels = input_ids[:, 1:] by attention_mask[:, :-1]. On a padded row the last real position's prediction of the
# first pad token is therefore counted in the summed loss (while num_tokens still counts real targets only).
# Fix: weight by attention_mask[:, 1:], the mask of the labels.
# Trimmed to CPU: device "cuda" -> "cpu", tensor_parallel dropped, a tiny Llama-architecture checkpoint (Skywork-13B
# is one) and a character-level tokenizer written to a local folder stand in for --model-path, and a short list of
# texts stands in for the jsonl data set.
import argparse
import logging
import os
import random
import string
import sys
import tempfile

import numpy as np
import torch
from torch.nn import CrossEntropyLoss
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Tokenizer

FIXED = "--fixed" in sys.argv
logging.getLogger("transformers").setLevel(logging.ERROR)
device = "cpu"


def compute_loss(tokenized_texts, attention_mask, model, tokenizer, add_start_token=False):

    loss_func = CrossEntropyLoss(reduction="none")

    if add_start_token:
        tokenizer.bos_token = getattr(tokenizer, "bos_token", "<s>")
        tokenizer.bos_token_id = getattr(tokenizer, "bos_token_id", len(tokenizer)-101)
        bos_tokens_tensor = torch.tensor(
            [[tokenizer.bos_token_id]] * tokenized_texts.size(dim=0))
        tokenized_texts = torch.cat(
            [bos_tokens_tensor, tokenized_texts], dim=1).to(device)
        attention_mask = torch.cat(
            [torch.ones(bos_tokens_tensor.size(), dtype=torch.int64), attention_mask], dim=1
        ).to(device)
    else:
        tokenized_texts = tokenized_texts.to(device)
        attention_mask = attention_mask.to(device)

    labels = tokenized_texts[:, 1:]

    with torch.no_grad():
        logits = model(tokenized_texts, attention_mask=attention_mask).logits
        logits = logits[:, :-1]
        if FIXED:
            loss = loss_func(logits.transpose(1, 2), labels) * attention_mask[:, 1:]
        else:
            loss = loss_func(logits.transpose(1, 2), labels) * attention_mask[:, :-1]

    num_tokens = torch.sum(attention_mask).item() - attention_mask.size(0)
    return torch.sum(loss).item(), num_tokens


def make_checkpoint():
    chars = list(string.ascii_lowercase) + ["\u0120", ",", ".", "?"]
    vocab = {"</s>": 0}
    for ch in chars:
        vocab[ch] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, bos_token=None, pad_token=None, eos_token="</s>")
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                         bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    torch.manual_seed(0)
    path = tempfile.mkdtemp()
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def load_model_tokenizer_config():
    from transformers import AutoModelForCausalLM, AutoConfig
    config = AutoConfig.from_pretrained(args.model_path, trust_remote_code=True)
    tokenizer = Qwen2Tokenizer.from_pretrained(args.model_path)
    model = AutoModelForCausalLM.from_pretrained(args.model_path, config=config, trust_remote_code=True).eval()
    return model, tokenizer, config


def main():

    model, tokenizer, config = load_model_tokenizer_config()

    tokenizer.padding_side = "right"
    tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token is not None else "[PAD]"

    input_texts = [
        "the quick brown fox jumps over the lazy dog, and then it runs away into the forest.",
        "a short line.",
        "what is the capital of france? the capital of france is paris.",
        "one two three four five six.",
        "loss evaluation on held out text measures how well the model predicts each next token.",
        "hello world.",
    ]
    if args.max_tokens is not None:
        input_texts = [text[:args.max_tokens//3] for text in input_texts]

    print("input_texts numbers is", len(input_texts))

    total_loss = 0
    total_tokens = 0
    for i in range(0, len(input_texts), args.batch_size):
        start_idx = i
        end_idx = min(i + args.batch_size, len(input_texts))
        batch_texts = input_texts[start_idx:end_idx]
        tokenized_texts = tokenizer(batch_texts, add_special_tokens=False, padding=True, truncation=True,
                                    max_length=args.max_tokens, return_tensors="pt")

        loss, num_tokens = compute_loss(tokenized_texts=tokenized_texts["input_ids"],
                                        attention_mask=tokenized_texts["attention_mask"], model=model,
                                        tokenizer=tokenizer, add_start_token=False)
        total_loss += loss
        total_tokens += num_tokens

    with open(args.output_file, "w", encoding="utf8") as f:
        avg_loss = total_loss / total_tokens
        f.write(f"{avg_loss:.4f}\t{total_tokens}\n")
        print(f"{avg_loss:.4f}\t{total_tokens}\n")


def set_seed(seed: int):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


if __name__ == '__main__':

    parser = argparse.ArgumentParser()
    parser.add_argument("-m", "--model-path", type=str, default="")
    parser.add_argument("-b", "--batch-size", type=int, default=3)
    parser.add_argument("-o", "--output-file", type=str, default=None)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--fixed", action="store_true")

    args = parser.parse_args()
    if not args.model_path:
        args.model_path = make_checkpoint()
    if args.output_file is None:
        args.output_file = os.path.join(tempfile.mkdtemp(), "eval_loss.txt")
    set_seed(1234)

    main()
