# Natooz/MidiTok commit 819ae2d ("Fix the "no pad_token_id" bug in generation"), example notebook
# colab-notebooks/Full_Example_HuggingFace_GPT2_Transformer.ipynb as commit f5cf71d left it: the test
# prompts (REMI token ids) are padded on the LEFT with PAD_None by collate_gen_left and handed to
# GPT2LMHeadModel.generate without an attention mask. The GPT2Config names the pad as
# `padding_token_id` and the GenerationConfig has no pad_token_id, so generate falls back to the EOS
# id as pad and keeps every position, PAD_None included. Fix: pass pad_token_id=config.padding_token_id
# to the GenerationConfig, so generate builds its attention mask from the pad id.
import sys
from copy import deepcopy
from typing import Dict, List

import torch
from torch import LongTensor, cat, flip, full
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset
from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# miditok.REMI stands in as its vocabulary: special tokens first (PAD, BOS, EOS), then the REMI tokens.
special_tokens = ["PAD", "BOS", "EOS"]
vocab = [f"{t}_None" for t in special_tokens] + ["Bar_None"]
vocab += [f"Position_{i}" for i in range(8)] + [f"Pitch_{p}" for p in range(60, 72)]
vocab += [f"Velocity_{v}" for v in (31, 63, 95, 127)] + [f"Duration_{d}" for d in ("0.2.8", "0.4.8", "1.0.8")]
tokenizer = {tok: i for i, tok in enumerate(vocab)}


class MIDIDataset(Dataset):
    r"""Dataset for generator training (samples of token ids, as loaded from the tokenized JSON files)."""

    def __init__(self, samples: List[LongTensor]):
        self.samples = samples

    def __getitem__(self, idx) -> Dict[str, LongTensor]:
        return {"input_ids": self.samples[idx], "labels": self.samples[idx]}

    def __len__(self) -> int:
        return len(self.samples)


first_tokens = len(special_tokens)
lengths = [14, 9, 12, 6]
subset_valid = MIDIDataset([torch.randint(first_tokens, len(tokenizer), (n,)) for n in lengths])

# Creates model
config = GPT2Config(
    vocab_size=len(tokenizer),
    n_positions=128,
    n_embd=64,
    n_layer=2,
    n_head=4,
    n_inner=128,
    resid_pdrop=.1,
    embd_pdrop=.1,
    attn_pdrop=.1,
    padding_token_id=tokenizer['PAD_None'],
    bos_token_id=tokenizer['BOS_None'],
    eos_token_id=tokenizer['EOS_None'],
)
model = GPT2LMHeadModel(config)

# (training with the Trainer runs here in the notebook)


def collate_gen_left(batch: List[Dict[str, LongTensor]]) -> LongTensor:
    # Here the sequences are padded to the left, so that the last token along the time dimension
    # is always the last token of each seq, allowing to efficiently generate by batch
    bos_shape = (1,)
    batch = [flip(cat([full(bos_shape, tokenizer["BOS_None"]), seq["input_ids"]], dim=0), dims=(0,)) for seq in batch]
    batch = pad_sequence(batch, batch_first=True, padding_value=tokenizer["PAD_None"])  # (N,T) or (N,T,Z)
    batch = flip(batch, dims=(1,)).long()
    return batch  # (N,T)


generation_kwargs = dict(
    max_new_tokens=8,  # extends samples by 8 tokens
    num_beams=1,        # no beam search
    do_sample=True,     # but sample instead
    temperature=0.9,
    top_k=15,
    top_p=0.95,
    epsilon_cutoff=3e-4,
    eta_cutoff=1e-3,
)
if FIXED:
    generation_kwargs["pad_token_id"] = config.padding_token_id
generation_config = GenerationConfig(**generation_kwargs)

dataloader_test = DataLoader(subset_valid, batch_size=16, collate_fn=collate_gen_left)
model.eval()
count = 0
for batch in dataloader_test:  # (N,T)
    torch.manual_seed(1)
    res = model.generate(batch.to(model.device), generation_config=generation_config)  # (N,T)

    # Saves the generated music (the notebook writes MIDI files and tokens json)
    for prompt, continuation in zip(batch, res):
        generated = continuation[len(prompt):]
        tokens = [generated, prompt, continuation]
        tokens = [seq.tolist() for seq in deepcopy(tokens)]
        print(f"sample {count}: prompt {len(prompt)} tokens, continuation {tokens[0]}")
        count += 1
