# FastChat (lm-sys/FastChat#183): fastchat/train/train.py _mask_targets started cur_idx at 0, ignoring the
# system header, so the human-turn mask was shifted: header/assistant tokens were masked and human tokens supervised.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
IGNORE_INDEX = -100


class CharTokenizer:
    """Stand-in for the LLaMA tokenizer: one id per character, pad id 0."""
    pad_token_id = 0
    model_max_length = 256

    def __call__(self, text):
        return torch.tensor([[1 + (ord(c) % 60) for c in text]])


def _tokenize_fn(strings, tokenizer):
    tokenized_list = [tokenizer(text) for text in strings]
    input_ids = labels = [t[0] for t in tokenized_list]
    input_ids_lens = labels_lens = [t.ne(tokenizer.pad_token_id).sum().item() for t in tokenized_list]
    return dict(input_ids=input_ids, labels=labels, input_ids_lens=input_ids_lens, labels_lens=labels_lens)


if not FIXED:
    def _mask_targets(target, tokenized_lens, speakers):
        cur_idx = 0
        for tokenized_len, speaker in zip(tokenized_lens, speakers):
            if speaker == "human":
                target[cur_idx:cur_idx + tokenized_len] = IGNORE_INDEX
            cur_idx += tokenized_len
else:
    def _mask_targets(target, tokenized_lens, speakers):
        # cur_idx = 0
        cur_idx = tokenized_lens[0]
        tokenized_lens = tokenized_lens[1:]
        target[:cur_idx] = IGNORE_INDEX
        for tokenized_len, speaker in zip(tokenized_lens, speakers):
            if speaker == "human":
                target[cur_idx + 2:cur_idx + tokenized_len] = IGNORE_INDEX
            cur_idx += tokenized_len


def _add_speaker_and_signal(header, source):
    BEGIN_SIGNAL, END_SIGNAL = "### ", "\n"
    conversation = header
    for sentence in source:
        from_str = "Human" if sentence["from"] == "human" else "Assistant"
        sentence["value"] = BEGIN_SIGNAL + from_str + ": " + sentence["value"] + END_SIGNAL
        conversation += sentence["value"]
    return conversation


def preprocess(sources, tokenizer):
    header = "A chat.\n\n"
    conversations = [_add_speaker_and_signal(header, [dict(s) for s in source]) for source in sources]
    conversations_tokenized = _tokenize_fn(conversations, tokenizer)
    input_ids = conversations_tokenized["input_ids"]
    targets = [t.clone() for t in input_ids]
    for target, source in zip(targets, sources):
        src = [dict(s) for s in source]
        _add_speaker_and_signal(header, src)
        tokenized_lens = _tokenize_fn([header] + [s["value"] for s in src], tokenizer)["input_ids_lens"]
        speakers = [s["from"] for s in src]
        _mask_targets(target, tokenized_lens, speakers)
    return dict(input_ids=input_ids, labels=targets)


class TinyCausalLM(nn.Module):
    def __init__(self, vocab=64, d=32, h=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.attn = nn.MultiheadAttention(d, h, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids, labels):
        x = self.emb(input_ids)
        T = x.shape[1]
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
        x = x + self.attn(x, x, x, attn_mask=causal, need_weights=False)[0]
        logits = self.head(x)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                               ignore_index=IGNORE_INDEX)


source = [{"from": "human", "value": "hi there"}, {"from": "gpt", "value": "hello, how can I help"},
          {"from": "human", "value": "tell a joke"}, {"from": "gpt", "value": "no"}]
tok = CharTokenizer()
data = preprocess([source], tok)
ids, labels = data["input_ids"][0][None], data["labels"][0][None]

# reference: which positions belong to assistant turns (what the loss should supervise)
header = "A chat.\n\n"
src = [dict(s) for s in source]
_add_speaker_and_signal(header, src)
ref = torch.zeros(ids.shape[1], dtype=torch.bool)
cur = len(header)
for s, orig in zip(src, source):
    if orig["from"] == "gpt":
        ref[cur:cur + len(s["value"])] = True
    cur += len(s["value"])
sup = labels[0] != IGNORE_INDEX
print("supervised tokens:", int(sup.sum()), "of which outside assistant turns:", int((sup & ~ref).sum()))
model = TinyCausalLM()
loss = model(ids, labels)
print("loss:", round(loss.item(), 6))
