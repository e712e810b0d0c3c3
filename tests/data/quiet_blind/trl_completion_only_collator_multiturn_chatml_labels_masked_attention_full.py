"""TRL SFT completion-only collator on multi-turn ChatML: user/system turns get label -100, attention sees all.

Follows huggingface/trl's DataCollatorForCompletionOnlyLM (trl/trainer/utils.py, with instruction_template and
response_template for multi-turn: every token from an instruction template up to the next response template is
set to ignore_index). The labels say which tokens are TRAINED; the attention_mask, from the tokenizer's right
padding, says which tokens are SEEN, so the assistant's second reply reads the whole dialogue before it. The model
is an nn.TransformerEncoder used as a decoder-only LM (causal mask + src_key_padding_mask). Mask meant: causal
over the real tokens of the whole conversation, right padding hidden as keys.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
IGNORE_INDEX = -100
VOCAB = {"<pad>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "system": 3, "user": 4, "assistant": 5, "\n": 6}
INSTRUCTION_TEMPLATE = [1, 4, 6]   # "<|im_start|>user\n"
RESPONSE_TEMPLATE = [1, 5, 6]      # "<|im_start|>assistant\n"


def find(seq, tmpl):
    return [i for i in range(len(seq) - len(tmpl) + 1) if seq[i:i + len(tmpl)] == tmpl]


def chatml(messages):
    ids = []
    for role, words in messages:
        ids += [1, VOCAB[role], 6] + words + [2, 6]
    return ids


class DataCollatorForCompletionOnlyLM:
    def __init__(self, response_template, instruction_template, pad_token_id=0):
        self.response_template = response_template
        self.instruction_template = instruction_template
        self.pad_token_id = pad_token_id

    def __call__(self, examples):
        max_len = max(len(e) for e in examples)
        input_ids = torch.full((len(examples), max_len), self.pad_token_id)
        attention_mask = torch.zeros(len(examples), max_len, dtype=torch.long)
        labels = torch.full((len(examples), max_len), IGNORE_INDEX)
        for i, ids in enumerate(examples):
            input_ids[i, :len(ids)] = torch.tensor(ids)
            attention_mask[i, :len(ids)] = 1
            labels[i, :len(ids)] = torch.tensor(ids)
            resp = [r + len(self.response_template) for r in find(ids, self.response_template)]
            instr = find(ids, self.instruction_template)
            # everything before the first response, and each instruction..next response, is not trained
            labels[i, :resp[0]] = IGNORE_INDEX
            for start in instr:
                nxt = [r for r in resp if r > start]
                end = nxt[0] if nxt else len(ids)
                labels[i, start:end] = IGNORE_INDEX
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class DecoderOnlyLM(nn.Module):
    def __init__(self, vocab=48, d=32, heads=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(128, d)
        layer = nn.TransformerEncoderLayer(d, heads, 64, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids, attention_mask):
        t = input_ids.shape[1]
        h = self.emb(input_ids) + self.pos(torch.arange(t))
        causal = nn.Transformer.generate_square_subsequent_mask(t)
        # float padding mask, same dtype as the causal mask (right padding: every query keeps key 0)
        pad = torch.zeros(attention_mask.shape).masked_fill(attention_mask == 0, float("-inf"))
        return self.head(self.body(h, mask=causal, src_key_padding_mask=pad, is_causal=True))


def main():
    convs = [
        chatml([("system", [20]), ("user", [21, 22]), ("assistant", [30, 31]),
                ("user", [23]), ("assistant", [32, 33, 34])]),
        chatml([("user", [24, 25, 26]), ("assistant", [35])]),
    ]
    batch = DataCollatorForCompletionOnlyLM(RESPONSE_TEMPLATE, INSTRUCTION_TEMPLATE)(convs)
    model = DecoderOnlyLM()
    logits = model(batch["input_ids"], batch["attention_mask"])
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1),
                           ignore_index=IGNORE_INDEX)
    loss.backward()
    trained = (batch["labels"] != IGNORE_INDEX).sum().item()
    seen = batch["attention_mask"].sum().item()
    assert trained < seen and torch.isfinite(loss)
    print(f"loss {loss.item():.4f}; trained tokens {trained} of {seen} attended")


if __name__ == "__main__":
    main()
