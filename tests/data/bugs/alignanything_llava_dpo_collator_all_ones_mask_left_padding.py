# PKU-Alignment/align-anything#96 (commit 9df86b9), datasets/text_image_to_text/preference.py PreferenceCollator.
# Bug: the collator overwrites the processor's mask with new_ones() over the already left-padded concatenated
# better+worse input_ids (then right_padding), i.e. an all-ones mask, so every real token attends to the left pads.
import sys
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
PAD = 0


def right_padding(sequences, padding_value):
    return torch.nn.utils.rnn.pad_sequence(sequences, batch_first=True, padding_value=padding_value)


def processor(text, padding_side="left"):
    """Text part of the HF processor call (padding=True, padding_side, returns input_ids + attention_mask)."""
    L = max(map(len, text))
    ids, att = [], []
    for t in text:
        pad = [PAD] * (L - len(t))
        ids.append(pad + t if padding_side == "left" else t + pad)
        att.append([0] * len(pad) + [1] * len(t) if padding_side == "left" else [1] * len(t) + [0] * len(pad))
    return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(att)}


class PreferenceCollator:
    def __init__(self, pad_token_id, padding_side="right"):
        self.pad_token_id = pad_token_id
        self.padding_func = right_padding
        self.padding_side = padding_side

    def __call__(self, samples):
        return_dict = {}
        concated_text = [s["better_conversation"] for s in samples] + [s["worse_conversation"] for s in samples]
        multi_modal_padding = processor(text=concated_text, padding_side=self.padding_side)
        for key, value in multi_modal_padding.items():
            return_dict[key] = value
        if not FIXED:
            attention_mask = [
                input_id.new_ones(input_id.size(), dtype=torch.bool) for input_id in return_dict["input_ids"]
            ]  # size = (2 * B, L)
            return_dict["attention_mask"] = self.padding_func(attention_mask, padding_value=0)
        return_dict["better_response_lens"] = [s["better_response_lens"] for s in samples]
        return_dict["worse_response_lens"] = [s["worse_response_lens"] for s in samples]
        return_dict["response_lens"] = return_dict["better_response_lens"] + return_dict["worse_response_lens"]
        return return_dict


def strip_pad(seq, pad_token_id):
    return seq[seq != pad_token_id]


def gather_log_probabilities(logits, labels):
    return torch.gather(F.log_softmax(logits, dim=-1), -1, labels.unsqueeze(-1)).squeeze(-1)


def compute_log_probs(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    input_ids = batch["input_ids"]
    logprob_list = []
    for idx in range(len(batch["response_lens"])):
        response_length = batch["response_lens"][idx]
        raw_input_id = strip_pad(input_ids[idx], PAD)
        logit = logits[idx][-response_length:].unsqueeze(0)
        input_id = raw_input_id[-response_length:].unsqueeze(0)
        logprob_list.append(gather_log_probabilities(logit[:, :-1], input_id[:, 1:]).squeeze(0))
    return torch.nn.utils.rnn.pad_sequence(logprob_list, batch_first=True, padding_value=0.0)


cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD, bos_token_id=1, eos_token_id=2)
cfg._attn_implementation = "eager"
model = LlamaForCausalLM(cfg).eval()

g = torch.Generator().manual_seed(1)
rnd = lambda n: torch.randint(3, 64, (n,), generator=g).tolist()
samples = []
for p_len, b_len, w_len in [(5, 6, 3), (8, 4, 7)]:
    prompt, better, worse = [1] + rnd(p_len), rnd(b_len) + [2], rnd(w_len) + [2]
    samples.append({"better_conversation": prompt + better, "worse_conversation": prompt + worse,
                    "better_response_lens": len(better), "worse_response_lens": len(worse)})

batch = PreferenceCollator(PAD, padding_side="left")(samples)  # the DPO trainer builds it with padding_side='left'
with torch.no_grad():
    log_probs = compute_log_probs(model, batch)
    texts = [s["better_conversation"] for s in samples] + [s["worse_conversation"] for s in samples]
    worst = 0.0
    for idx, t in enumerate(texts):  # reference: each conversation alone, no padding
        ids = torch.tensor([t])
        n = batch["response_lens"][idx]
        ref = gather_log_probabilities(model(ids).logits[:, -n:][:, :-1], ids[:, -n:][:, 1:])[0]
        worst = max(worst, (log_probs[idx, : n - 1] - ref).abs().max().item())

print("sequence log-probs:", [round(x, 5) for x in log_probs.sum(-1).tolist()])
print(f"max |batched response log-probs - each conversation alone|: {worst:.6e}")
