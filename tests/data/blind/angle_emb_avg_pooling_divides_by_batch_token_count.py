"""AnglE (angle_emb) 'avg' pooling divided each row's masked sum by the whole batch's token count.

Citation: SeanLee97/AnglE#102 (fixes #101), commit 9acf28f "fix mean pooling (#102)"
(angle_emb/angle.py, ``get_pooling``).

The bug: ``pooling_strategy == 'avg'`` computed
``torch.sum(outputs * inputs["attention_mask"][:, :, None], dim=1) / torch.sum(inputs["attention_mask"])``:
the denominator sums the attention mask over the batch *and* the sequence, so every sentence is
divided by the number of real tokens in the whole right-padded batch, not by its own length. The
embedding of a sentence then depends on its batch neighbours, and short and long sentences get
scaled differently.

The fix: divide by ``inputs["attention_mask"].sum(dim=1).unsqueeze(1)`` (per-row count of real tokens).

This program keeps AnglE's ``get_pooling`` / ``Pooler`` / ``AnglE.encode`` layout (a BERT backbone as
``AutoModel`` gives it, the pooler reading ``hidden_states[layer_index]``, a right-padded tokenizer
batch) at toy sizes with random weights and a tiny word-piece vocabulary written to a temp dir.
It encodes one query and a batch of documents, then ranks the documents by dot product.
"""

import os
import sys
import tempfile
from typing import Dict, List, Optional, Union

import numpy as np
import torch
from torch import nn
from transformers import BertConfig, BertModel, BertTokenizer

FIXED = "--fixed" in sys.argv


def get_pooling(outputs: torch.Tensor,
                inputs: Dict,
                pooling_strategy: str,
                padding_side: str) -> torch.Tensor:
    """ Pooling the model outputs.

    :param outputs:  torch.Tensor. Model outputs (without pooling)
    :param inputs:  Dict. Model inputs
    :param pooling_strategy:  str. Pooling strategy ['cls', 'cls_avg', 'cls_max', 'last', 'avg', 'max', 'all', index]
    :param padding_side:  str. Padding strategy of tokenizers (`left` or `right`).
    """
    if pooling_strategy == 'cls':
        outputs = outputs[:, 0]
    elif pooling_strategy == 'cls_avg':
        avg = torch.sum(
            outputs * inputs["attention_mask"][:, :, None], dim=1) / torch.sum(inputs["attention_mask"])
        outputs = (outputs[:, 0] + avg) / 2.0
    elif pooling_strategy == 'cls_max':
        maximum, _ = torch.max(outputs * inputs["attention_mask"][:, :, None], dim=1)
        outputs = (outputs[:, 0] + maximum) / 2.0
    elif pooling_strategy == 'last':
        batch_size = inputs['input_ids'].shape[0]
        sequence_lengths = -1 if padding_side == 'left' else inputs["attention_mask"].sum(dim=1) - 1
        outputs = outputs[torch.arange(batch_size, device=outputs.device), sequence_lengths]
    elif pooling_strategy == 'avg':
        if FIXED:
            outputs = torch.sum(outputs * inputs["attention_mask"][:, :, None], dim=1) / inputs["attention_mask"].sum(dim=1).unsqueeze(1)
        else:
            outputs = torch.sum(
                outputs * inputs["attention_mask"][:, :, None], dim=1) / torch.sum(inputs["attention_mask"])
    elif pooling_strategy == 'max':
        outputs, _ = torch.max(outputs * inputs["attention_mask"][:, :, None], dim=1)
    elif pooling_strategy == 'all':
        # keep outputs
        pass
    elif isinstance(pooling_strategy, int) or pooling_strategy.isnumeric():
        # index
        outputs = outputs[:, int(pooling_strategy)]
    else:
        raise NotImplementedError(
            'please specify pooling_strategy from [`cls`, `last`, `avg`, `max`, `last_avg`, `all`, int]')
    return outputs


class Pooler:
    """
    Using Pooler to obtain sentence embeddings.
    """
    def __init__(self,
                 model: nn.Module,
                 pooling_strategy: Optional[Union[int, str]] = None,
                 padding_side: Optional[str] = None):
        self.model = model
        self.pooling_strategy = pooling_strategy
        self.padding_side = padding_side

    def __call__(self,
                 inputs: Dict,
                 layer_index: int = -1,
                 embedding_start: Optional[int] = None,
                 embedding_size: Optional[int] = None,
                 return_all_layer_outputs: bool = False,
                 pooling_strategy: Optional[Union[int, str]] = None) -> torch.Tensor:
        ret = self.model(output_hidden_states=True, return_dict=True, **inputs)
        all_layer_outputs = ret.hidden_states
        if return_all_layer_outputs:
            return all_layer_outputs
        outputs = all_layer_outputs[layer_index]
        outputs = get_pooling(outputs, inputs,
                              pooling_strategy or self.pooling_strategy,
                              padding_side=self.padding_side)
        n_dim = len(outputs.shape)
        if embedding_start is not None:
            if n_dim == 2:
                outputs = outputs[:, embedding_start:]
            elif n_dim == 3:
                outputs = outputs[:, :, embedding_start:]
        if embedding_size is not None:
            if n_dim == 2:
                outputs = outputs[:, :embedding_size]
            elif n_dim == 3:
                outputs = outputs[:, :, :embedding_size]
        return outputs


class AnglE:
    """Trimmed AnglE: a BERT backbone (AutoModel) + its tokenizer + Pooler."""

    def __init__(self, backbone: nn.Module, tokenizer, max_length: int = 512,
                 pooling_strategy: Optional[str] = None, device: str = 'cpu'):
        self.backbone = backbone
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.pooling_strategy = pooling_strategy
        self.device = device
        self.pooler = Pooler(
            self.backbone,
            pooling_strategy=self.pooling_strategy,
            padding_side=self.tokenizer.padding_side)

    def encode(self,
               inputs: Union[List[str], str],
               max_length: Optional[int] = None,
               to_numpy: bool = True,
               embedding_start: int = 0,
               embedding_size: Optional[int] = None,
               device: Optional[str] = None,
               normalize_embedding: bool = False,
               padding: str = 'longest'):
        self.backbone.eval()
        if device is None:
            device = self.device
        if not isinstance(inputs, (tuple, list)):
            inputs = [inputs]
        max_length = max_length or self.max_length
        tok = self.tokenizer(
            inputs,
            padding=padding,
            max_length=max_length or self.max_length,
            truncation=True,
            return_tensors='pt')
        tok.to(device)
        with torch.no_grad():
            output = self.pooler(tok,
                                 embedding_start=embedding_start,
                                 embedding_size=embedding_size)
        if normalize_embedding:
            output = nn.functional.normalize(output, p=2, dim=-1)
        if to_numpy:
            return output.float().detach().cpu().numpy()
        return output


WORDS = ("the a cat dog sat on mat rug ran in park garden sun rain cold warm day night "
         "house car red blue big small old new river tree bird fish").split()


def main():
    torch.manual_seed(0)
    tmp = tempfile.mkdtemp()
    vocab_file = os.path.join(tmp, "vocab.txt")
    with open(vocab_file, "w") as f:
        f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS) + "\n")
    tokenizer = BertTokenizer(vocab_file)  # padding_side 'right'

    config = BertConfig(vocab_size=len(WORDS) + 5, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                        attn_implementation="eager")
    backbone = BertModel(config, add_pooling_layer=False)
    backbone.eval()

    angle = AnglE(backbone, tokenizer, max_length=32, pooling_strategy='avg')

    query = "the cat sat on the mat"
    docs = [
        "a cat sat on a rug",
        "the old red car ran in the rain on a cold night near the big river and the tree",
        "dog in park",
        "the small bird sat in the new tree in the garden on a warm day in the sun",
    ]
    q = angle.encode(query)
    d = angle.encode(docs)
    print("query embedding[:4]:", np.round(q[0, :4], 4))
    for i, doc in enumerate(docs):
        print(f"doc {i} embedding[:4]:", np.round(d[i, :4], 4), "norm", round(float(np.linalg.norm(d[i])), 4))
    scores = (q @ d.T)[0]
    print("dot-product scores:", np.round(scores, 4))
    print("ranking:", list(np.argsort(-scores)))


if __name__ == "__main__":
    main()
