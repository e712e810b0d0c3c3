"""MOSS supervised fine-tuning collator: the attention mask is padded from the input ids, not the masks.

Citation: OpenMOSS/MOSS#165 ("finetune_moss.py#L121"), fixed in OpenMOSS/MOSS commit 222b676
("Update finetune_moss.py"): finetune_moss.py, SFTDataset.collate_fn.

The bug: __getitem__ returns (data, attn_mask, label) with attn_mask = ones_like(data), but collate_fn
builds the batch mask with
``pad_sequence(batch_input_ids, batch_first=True, padding_value=0).to(torch.bool)`` -- it pads the
(already padded) input ids again and casts them to bool. The rows are right-padded with
tokenizer.eos_token_id (106068, the <eom> token), so the padding is non-zero and stays attended, and
every real token whose id is 0 (the BPE token "!" in MOSS's CodeGen-derived vocabulary) gets mask 0 and
is hidden from every later token of its sample during training and validation.

The fix: ``pad_sequence(batch_attn_mask, batch_first=True, padding_value=0).to(torch.bool)``, so real
tokens are all 1 and the eos padding is 0.

Toy sizes, random weights: MossForCausalLM (a CodeGen model) is transformers' CodeGenForCausalLM from a
tiny CodeGenConfig; the tokenizer is not needed because the dataset loads pre-tokenised
``train_data`` / ``train_no_loss_spans`` files, as SFTDataset.load_data does when they exist.
"""

import copy
import logging
import os
import sys
import tempfile

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import CodeGenConfig, CodeGenForCausalLM, set_seed

FIXED = "--fixed" in sys.argv

logger = logging.getLogger(__name__)


class _Tok:
    # tokenizer.eos_token_id = 106068  (finetune_moss.py maps eos to <eom>)
    eos_token_id = 106068


class SFTDataset(Dataset):
    def __init__(self, data_dir, tokenizer, data_type='train'):
        super().__init__()

        self.data_dir = data_dir
        self.tokenizer = tokenizer
        self.data_type = data_type

        self.data = []
        # We do not calculate losses for the meta instruction or results returned by plugins
        # The token spans with label -100, [(span_start, span_end), ...]
        self.no_loss_spans = []

        self.load_data()

    def load_data(self):
        logger.info("Loading data...")
        data_file = os.path.join(self.data_dir, f'{self.data_type}_data')
        no_loss_spans_file = os.path.join(self.data_dir, f'{self.data_type}_no_loss_spans')
        self.data = torch.load(data_file, map_location='cpu')
        self.no_loss_spans = torch.load(no_loss_spans_file, map_location='cpu')
        logger.info(f"Load data successfully, total {len(self.data)} training samples")

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        data = copy.deepcopy(self.data[index])
        no_loss_spans = copy.deepcopy(self.no_loss_spans[index])

        data = torch.tensor(data, dtype=torch.long)
        attn_mask = torch.ones_like(data, dtype=torch.bool)
        label = copy.deepcopy(data)

        for no_loss_span in no_loss_spans:
            label[no_loss_span[0] : no_loss_span[1]] = -100

        return data, attn_mask, label

    def collate_fn(self, batch):
        batch_input_ids, batch_attn_mask, batch_labels = [], [], []
        for input_ids, attn_mask, label in batch:
            batch_input_ids.append(input_ids)
            batch_attn_mask.append(attn_mask)
            batch_labels.append(label)

        batch_input_ids = torch.nn.utils.rnn.pad_sequence(batch_input_ids, batch_first=True, padding_value=self.tokenizer.eos_token_id)
        if FIXED:
            batch_attn_mask = torch.nn.utils.rnn.pad_sequence(batch_attn_mask, batch_first=True, padding_value=0).to(torch.bool)
        else:
            batch_attn_mask = torch.nn.utils.rnn.pad_sequence(batch_input_ids, batch_first=True, padding_value=0).to(torch.bool)
        batch_labels = torch.nn.utils.rnn.pad_sequence(batch_labels, batch_first=True, padding_value=-100)

        return batch_input_ids, batch_attn_mask, batch_labels


def write_data(data_dir):
    g = torch.Generator().manual_seed(0)
    meta = torch.randint(1, 5000, (6,), generator=g).tolist()
    # turn 1: "<|Human|>: ... <eoh>\n<|MOSS|>: Sure! ... <eom>\n"; token 0 is "!" in the BPE vocab
    s1 = meta + torch.randint(1, 5000, (5,), generator=g).tolist() + [0] + torch.randint(1, 5000, (6,), generator=g).tolist() + [106068]
    s2 = meta + torch.randint(1, 5000, (4,), generator=g).tolist() + [106068]
    s3 = meta + torch.randint(1, 5000, (3,), generator=g).tolist() + [0, 0] + torch.randint(1, 5000, (4,), generator=g).tolist() + [106068]
    data = [s1, s2, s3]
    spans = [[(0, len(meta))] for _ in data]
    torch.save(data, os.path.join(data_dir, 'train_data'))
    torch.save(spans, os.path.join(data_dir, 'train_no_loss_spans'))


def main():
    set_seed(42)
    tokenizer = _Tok()
    config = CodeGenConfig(
        vocab_size=106072, n_positions=64, n_ctx=64, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
        bos_token_id=106028, eos_token_id=106068, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
    )
    model = CodeGenForCausalLM(config)
    model.eval()

    with tempfile.TemporaryDirectory() as data_dir:
        write_data(data_dir)
        train_dataset = SFTDataset(data_dir, tokenizer)
    train_dataloader = DataLoader(train_dataset, batch_size=3, shuffle=False, drop_last=True, collate_fn=train_dataset.collate_fn)

    with torch.no_grad():
        for batch_cnt, (input_ids, attention_mask, labels) in enumerate(train_dataloader):
            output = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, return_dict=True)
            loss = output.loss
            print(f"step {batch_cnt}, loss: {loss.item():.6f}")


if __name__ == "__main__":
    main()
