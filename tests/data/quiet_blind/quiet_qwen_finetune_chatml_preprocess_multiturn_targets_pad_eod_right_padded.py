# Citation: QwenLM/Qwen finetune.py @00dceebbaaec2bf642ad327f7022ac9b6f8da187 (preprocess, SupervisedDataset, train:
#   padding_side="right", tokenizer.pad_token_id = tokenizer.eod_id, IGNORE_TOKEN_ID = LabelSmoother.ignore_index).
# Multi-turn ChatML SFT: every conversation gets the default system turn, then user / assistant turns as
# <|im_start|>role\n ... <|im_end|>\n. The targets keep only the assistant content (plus the <|im_start|>, <|im_end|>
# and the newline after it of every turn, as the script writes them) and set the rest to IGNORE_TOKEN_ID; each row is
# right-padded to model_max_length with <|endoftext|> (eod, which ChatML text never contains) and truncated to it,
# and attention_mask = input_ids.ne(pad_token_id). Qwen(-1)'s remote modeling_qwen.py is not in transformers, so the
# model is a tiny transformers Qwen2ForCausalLM (the same decoder family), called the way Trainer calls it
# (input_ids, labels, attention_mask); the tokenizer is a character-level stand-in that reads the ChatML specials.
# Self-check: each conversation's real tokens run alone, unpadded and unmasked: logits at every real position and the
# batch loss (mean over target tokens of the batch) by a double loop over shifted targets.
from typing import Dict

import torch
import transformers
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.trainer_pt_utils import LabelSmoother

torch.manual_seed(0)

IGNORE_TOKEN_ID = LabelSmoother.ignore_index


class QWenCharTokenizer:
    """Stand-in for tokenization_qwen.QWenTokenizer (tiktoken, allowed_special='all')."""

    SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

    def __init__(self):
        chars = sorted(set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:;?!'+-\n"))
        self.vocab = {c: i for i, c in enumerate(chars)}
        for t in self.SPECIAL:
            self.vocab[t] = len(self.vocab)
        self.eod_id = self.vocab["<|endoftext|>"]
        self.im_start_id = self.vocab["<|im_start|>"]
        self.im_end_id = self.vocab["<|im_end|>"]
        self.pad_token_id = None

    class _Out:
        def __init__(self, input_ids):
            self.input_ids = input_ids

    def __call__(self, text):
        ids, i = [], 0
        while i < len(text):
            hit = next((t for t in self.SPECIAL if text.startswith(t, i)), None)
            if hit is not None:
                ids.append(self.vocab[hit])
                i += len(hit)
            else:
                ids.append(self.vocab[text[i]])
                i += 1
        return self._Out(ids)


def preprocess(
    sources,
    tokenizer,
    max_len: int,
    system_message: str = "You are a helpful assistant."
) -> Dict:
    roles = {"user": "<|im_start|>user", "assistant": "<|im_start|>assistant"}

    im_start = tokenizer.im_start_id
    im_end = tokenizer.im_end_id
    nl_tokens = tokenizer('\n').input_ids
    _system = tokenizer('system').input_ids + nl_tokens
    _user = tokenizer('user').input_ids + nl_tokens
    _assistant = tokenizer('assistant').input_ids + nl_tokens

    # Apply prompt templates
    input_ids, targets = [], []
    for i, source in enumerate(sources):
        if roles[source[0]["from"]] != roles["user"]:
            source = source[1:]

        input_id, target = [], []
        system = [im_start] + _system + tokenizer(system_message).input_ids + [im_end] + nl_tokens
        input_id += system
        target += [im_start] + [IGNORE_TOKEN_ID] * (len(system)-3) + [im_end] + nl_tokens
        assert len(input_id) == len(target)
        for j, sentence in enumerate(source):
            role = roles[sentence["from"]]
            _input_id = tokenizer(role).input_ids + nl_tokens + \
                tokenizer(sentence["value"]).input_ids + [im_end] + nl_tokens
            input_id += _input_id
            if role == '<|im_start|>user':
                _target = [im_start] + [IGNORE_TOKEN_ID] * (len(_input_id)-3) + [im_end] + nl_tokens
            elif role == '<|im_start|>assistant':
                _target = [im_start] + [IGNORE_TOKEN_ID] * len(tokenizer(role).input_ids) + \
                    _input_id[len(tokenizer(role).input_ids)+1:-2] + [im_end] + nl_tokens
            else:
                raise NotImplementedError
            target += _target
        assert len(input_id) == len(target)
        input_id += [tokenizer.pad_token_id] * (max_len - len(input_id))
        target += [IGNORE_TOKEN_ID] * (max_len - len(target))
        input_ids.append(input_id[:max_len])
        targets.append(target[:max_len])
    input_ids = torch.tensor(input_ids, dtype=torch.int)
    targets = torch.tensor(targets, dtype=torch.int)

    return dict(
        input_ids=input_ids,
        labels=targets,
        attention_mask=input_ids.ne(tokenizer.pad_token_id),
    )


class SupervisedDataset(torch.utils.data.Dataset):
    def __init__(self, raw_data, tokenizer, max_len: int):
        super(SupervisedDataset, self).__init__()
        sources = [example["conversations"] for example in raw_data]
        data_dict = preprocess(sources, tokenizer, max_len)

        self.input_ids = data_dict["input_ids"]
        self.labels = data_dict["labels"]
        self.attention_mask = data_dict["attention_mask"]

    def __len__(self):
        return len(self.input_ids)

    def __getitem__(self, i) -> Dict[str, torch.Tensor]:
        return dict(
            input_ids=self.input_ids[i],
            labels=self.labels[i],
            attention_mask=self.attention_mask[i],
        )


raw_data = [
    {"id": "a", "conversations": [
        {"from": "user", "value": "hi"},
        {"from": "assistant", "value": "Hello! How can I help?"}]},
    {"id": "b", "conversations": [
        {"from": "user", "value": "2+2?"},
        {"from": "assistant", "value": "4."},
        {"from": "user", "value": "and 3+3?"},
        {"from": "assistant", "value": "6."}]},
    {"id": "c", "conversations": [  # starts with an assistant turn: preprocess drops it
        {"from": "assistant", "value": "Welcome."},
        {"from": "user", "value": "a color?"},
        {"from": "assistant", "value": "teal"}]},
    {"id": "d", "conversations": [  # longer than model_max_length: cut inside the second answer
        {"from": "user", "value": "list three animals"},
        {"from": "assistant", "value": "cat, dog, owl"},
        {"from": "user", "value": "now three more, with a short note on each one"},
        {"from": "assistant", "value": "fox: sly. elk: tall. bee: busy and small."}]},
]

model_max_length = 160
tokenizer = QWenCharTokenizer()
tokenizer.pad_token_id = tokenizer.eod_id

config = Qwen2Config(vocab_size=len(tokenizer.vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                     tie_word_embeddings=False, use_cache=False)
model = Qwen2ForCausalLM(config).eval()
for p in model.parameters():
    torch.nn.init.normal_(p, std=0.2) if p.dim() > 1 else torch.nn.init.uniform_(p, 0.8, 1.2)

train_dataset = SupervisedDataset(raw_data, tokenizer=tokenizer, max_len=model_max_length)
batch = transformers.default_data_collator([train_dataset[i] for i in range(len(train_dataset))])
assert batch["input_ids"].shape == (4, model_max_length)
assert not (batch["input_ids"][:, :1] == tokenizer.pad_token_id).any()

with torch.no_grad():
    out = model(input_ids=batch["input_ids"].long(), labels=batch["labels"].long(), attention_mask=batch["attention_mask"])

    total, count = 0.0, 0
    for b in range(batch["input_ids"].shape[0]):
        n = int(batch["attention_mask"][b].sum())
        ids = batch["input_ids"][b, :n].long()
        assert (batch["input_ids"][b, n:] == tokenizer.eod_id).all() and tokenizer.eod_id not in ids.tolist()
        ref_logits = model(input_ids=ids[None]).logits[0]
        torch.testing.assert_close(out.logits[b, :n], ref_logits, atol=1e-4, rtol=1e-4)
        labels = batch["labels"][b].tolist()
        for t in range(n - 1):
            if labels[t + 1] != IGNORE_TOKEN_ID:
                total += -torch.log_softmax(ref_logits[t], -1)[labels[t + 1]].item()
                count += 1
        for t in range(n, model_max_length):
            assert labels[t] == IGNORE_TOKEN_ID
        print(f"row {b}: {n} real tokens, {sum(l != IGNORE_TOKEN_ID for l in labels)} target tokens")
    assert abs(out.loss.item() - total / count) < 1e-4, (out.loss.item(), total / count)
print(f"loss {out.loss.item():.4f} (reference {total / count:.4f})")
print("ok")
