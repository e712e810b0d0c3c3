# Citation: NTMC-Community/MatchZoo-py PR #75 "Add BERT attention_mask and
#   token_type_ids" (commit 02ce245f39a5e0abbbbc036d164568b110248a68).
# Upstream: matchzoo/modules/bert_module.py BertModule.forward, called by
#   matchzoo/models/bert.py Bert.forward on batches padded by
#   matchzoo/dataloader/callbacks/padding.py BertPadding (BasicPadding, pad_mode
#   'pre', then [CLS]=101 inserted at column 0 and [SEP]=102 appended).
# Bug: BertModule.forward concatenated text_left and text_right and called
#   self.bert(inputs) with nothing else: no attention_mask (so the pre-padding of
#   both texts, which sits in the middle of the pair, is attended) and no
#   token_type_ids (the second text is read as segment 0).
# Fix: token_type_ids = cat(zeros_like(x), ones_like(y)); attention_mask =
#   (input_ids != 0); both passed to BertModel.
#
# Ported at tiny sizes: BertModel is transformers' BertModel built from a small
# BertConfig with random weights (upstream loads 'bert-base-uncased'); numpy in
# the padding callback is replaced by torch with the same logic.
import sys
import typing

import torch
import torch.nn as nn
from transformers import BertConfig, BertModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---- matchzoo/dataloader/callbacks/padding.py -------------------------------
def _padding_2D(input, output, mode: str = 'pre'):
    batch_size = min(output.shape[0], len(input))
    pad_length = output.shape[1]
    if mode == 'post':
        for i in range(batch_size):
            end_pos = min(len(input[i]), pad_length)
            if end_pos > 0:
                output[i][:end_pos] = torch.tensor(input[i][:end_pos])
    elif mode == 'pre':
        for i in range(batch_size):
            start_pos = min(len(input[i]), pad_length)
            if start_pos > 0:
                output[i][-start_pos:] = torch.tensor(input[i][-start_pos:])
    else:
        raise ValueError('{} is not a vaild pad mode.'.format(mode))


class BasicPadding:
    def __init__(self, fixed_length_left: int = None, fixed_length_right: int = None,
                 pad_word_value: typing.Union[int, str] = 0, pad_word_mode: str = 'pre'):
        self._fixed_length_left = fixed_length_left
        self._fixed_length_right = fixed_length_right
        self._pad_word_value = pad_word_value
        self._pad_word_mode = pad_word_mode

    def on_batch_unpacked(self, x: dict, y):
        batch_size = len(x['id_left'])
        pad_length_left = max(x['length_left'])
        pad_length_right = max(x['length_right'])
        if self._fixed_length_left is not None:
            pad_length_left = self._fixed_length_left
        if self._fixed_length_right is not None:
            pad_length_right = self._fixed_length_right
        for key, value in list(x.items()):
            if key == 'text_left':
                padded_value = torch.full([batch_size, pad_length_left],
                                          self._pad_word_value, dtype=torch.long)
                _padding_2D(value, padded_value, self._pad_word_mode)
            elif key == 'text_right':
                padded_value = torch.full([batch_size, pad_length_right],
                                          self._pad_word_value, dtype=torch.long)
                _padding_2D(value, padded_value, self._pad_word_mode)
            else:
                continue
            x[key] = padded_value


def _insert_column(arr, index, value):
    # np.insert(arr, index, value, axis=1)
    col = torch.full((arr.shape[0], 1), value, dtype=arr.dtype)
    return torch.cat([arr[:, :index], col, arr[:, index:]], dim=1)


class BertPadding:
    def __init__(self, fixed_length_left: int = None, fixed_length_right: int = None,
                 pad_value: typing.Union[int, str] = 0, pad_mode: str = 'pre'):
        self._padding = BasicPadding(fixed_length_left=fixed_length_left,
                                     fixed_length_right=fixed_length_right,
                                     pad_word_value=pad_value,
                                     pad_word_mode=pad_mode)

    def on_batch_unpacked(self, x: dict, y):
        self._padding.on_batch_unpacked(x, y)
        x['text_left'] = _insert_column(x['text_left'], 0, 101)
        x['text_left'] = _insert_column(x['text_left'], x['text_left'][0].numel(), 102)
        x['text_right'] = _insert_column(x['text_right'], x['text_right'][0].numel(), 102)


# ---- matchzoo/modules/bert_module.py -----------------------------------------
class BertModule(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.bert = BertModel(config)  # upstream: BertModel.from_pretrained(mode)

    def forward(self, x, y):
        """Forward."""
        if not FIXED:
            inputs = torch.cat((x, y), dim=-1)
            return self.bert(inputs)
        input_ids = torch.cat((x, y), dim=-1)
        token_type_ids = torch.cat((
            torch.zeros_like(x),
            torch.ones_like(y)), dim=-1).long()
        attention_mask = (input_ids != 0)
        return self.bert(input_ids=input_ids, token_type_ids=token_type_ids,
                         attention_mask=attention_mask)


# ---- matchzoo/models/bert.py -------------------------------------------------
class Bert(nn.Module):
    def __init__(self, config: BertConfig, num_classes: int = 2, dropout_rate: float = 0.0):
        super().__init__()
        self.bert = BertModule(config)
        self.dropout = nn.Dropout(p=dropout_rate)
        self.out = nn.Linear(config.hidden_size, num_classes)  # _make_output_layer

    def forward(self, inputs):
        input_left, input_right = inputs['text_left'], inputs['text_right']
        bert_output = self.bert(input_left, input_right)[1]
        out = self.out(self.dropout(bert_output))
        return out


def make_batch():
    # word-piece ids from BertPreprocessor (tokenizer.encode, no special tokens)
    g = torch.Generator().manual_seed(1)
    lefts = [[int(t) for t in torch.randint(1000, 1100, (n,), generator=g)] for n in (5, 3, 6, 2)]
    rights = [[int(t) for t in torch.randint(1000, 1100, (n,), generator=g)] for n in (7, 4, 9, 3)]
    x = {
        'id_left': ['q0', 'q1', 'q2', 'q3'],
        'text_left': lefts,
        'length_left': [len(t) for t in lefts],
        'text_right': rights,
        'length_right': [len(t) for t in rights],
    }
    y = torch.tensor([1, 0, 1, 0])
    return x, y


def main():
    config = BertConfig(vocab_size=1100, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64,
                        max_position_embeddings=64, type_vocab_size=2,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        attn_implementation="eager")
    model = Bert(config)
    x, y = make_batch()
    BertPadding(fixed_length_left=6, fixed_length_right=10, pad_value=0,
                pad_mode='pre').on_batch_unpacked(x, y)
    print("text_left[1]: ", x['text_left'][1].tolist())
    print("text_right[1]:", x['text_right'][1].tolist())

    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    for step in range(5):
        logits = model({'text_left': x['text_left'], 'text_right': x['text_right']})
        loss = loss_fn(logits, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.6f}")
    model.eval()
    with torch.no_grad():
        probs = model({'text_left': x['text_left'], 'text_right': x['text_right']}).softmax(-1)
    print("eval probs:", [round(v, 5) for v in probs[:, 1].tolist()])


if __name__ == "__main__":
    main()
