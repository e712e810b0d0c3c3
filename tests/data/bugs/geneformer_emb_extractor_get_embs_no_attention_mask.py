"""Geneformer EmbExtractor: cell embeddings of a padded minibatch of rank-value encoded cells.

Citation: ctheodoris/Geneformer commit 9169bfd ("Fixed error with perturbing individual genes and
updated ways to specify cell_states_to_model (#146)"; squashes c2679c4 "... add attn mask"),
geneformer/emb_extractor.py ``get_embs``; the code before it is the file as added in d154fee
("Add function to extract and plot cell embeddings").

The bug: ``get_embs`` pads each minibatch of cells (sorted longest first) to the longest cell with
the <pad> token (id 0) and mean-pools the chosen hidden layer over each cell's own length, but calls
the BERT model with ``input_ids`` only, so the model's self-attention runs over the whole padded row.

The fix: the forward call also passes ``attention_mask = gen_attention_mask(minibatch)`` (ones over
each cell's length, zeros over its padding).

Ported at toy sizes with random weights: a ``BertForMaskedLM`` built from a ``BertConfig`` in
Geneformer's layout (relu, pad_token_id 0, absolute positions) with ``output_hidden_states=True``,
a stand-in for the ``datasets.Dataset`` of tokenized cells (``input_ids``, ``length``), and
EmbExtractor's defaults ``emb_mode="cell"``, ``cell_emb_style="mean_pool"``, ``emb_layer=-1``.
"""

import re
import sys

import torch
from transformers import BertConfig, BertForMaskedLM

FIXED = "--fixed" in sys.argv
DEVICE = "cpu"  # "cuda" in the project


# ---- a minimal stand-in for the datasets.Dataset of tokenized cells ----------------------------
class CellDataset:
    def __init__(self, rows):
        self.rows = list(rows)
        self.format = None

    def __len__(self):
        return len(self.rows)

    def select(self, indices):
        return CellDataset([self.rows[i] for i in indices])

    def sort(self, column, reverse=False):
        return CellDataset(sorted(self.rows, key=lambda r: r[column], reverse=reverse))

    def set_format(self, type=None):
        self.format = type

    def __getitem__(self, column):
        values = [r[column] for r in self.rows]
        if self.format == "torch":
            return [torch.tensor(v) for v in values] if column == "input_ids" else torch.tensor(values)
        return values


# ---- geneformer/in_silico_perturber.py ----------------------------------------------------------
def load_model(model_type, num_classes, model_directory):
    # BertForMaskedLM.from_pretrained(model_directory, output_hidden_states=True,
    # output_attentions=False): here the config is built in place, weights random
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        hidden_act="relu",
        max_position_embeddings=32,
        pad_token_id=0,
        hidden_dropout_prob=0.02,
        attention_probs_dropout_prob=0.02,
        layer_norm_eps=1e-12,
        initializer_range=0.2,  # 0.02 in the config; a larger spread stands in for trained weights
        output_hidden_states=True,
        output_attentions=False,
        attn_implementation="eager",
    )
    model = BertForMaskedLM(config)
    # put the model in eval mode for fwd pass
    model.eval()
    model = model.to(DEVICE)
    return model


def quant_layers(model):
    layer_nums = []
    for name, parameter in model.named_parameters():
        if "layer" in name:
            layer_nums += [int(name.split("layer.")[1].split(".")[0])]
    return int(max(layer_nums)) + 1


def get_model_input_size(model):
    return int(re.split(r"\(|,", str(model.bert.embeddings.position_embeddings))[1])


def downsample_and_sort(data_shuffled, max_ncells):
    num_cells = len(data_shuffled)
    # if max number of cells is defined, then subsample to this max number
    if max_ncells is not None:
        num_cells = min(max_ncells, num_cells)
    data_subset = data_shuffled.select([i for i in range(num_cells)])
    # sort dataset with largest cell first to encounter any memory errors earlier
    data_sorted = data_subset.sort("length", reverse=True)
    return data_sorted


def pad_tensor(tensor, pad_token_id, max_len):
    tensor = torch.nn.functional.pad(
        tensor, pad=(0, max_len - tensor.numel()), mode="constant", value=pad_token_id
    )
    return tensor


def pad_tensor_list(tensor_list, dynamic_or_constant, pad_token_id, model_input_size):
    # Determine maximum tensor length
    if dynamic_or_constant == "dynamic":
        max_len = max([tensor.squeeze().numel() for tensor in tensor_list])
    elif type(dynamic_or_constant) == int:
        max_len = dynamic_or_constant
    else:
        max_len = model_input_size

    # pad all tensors to maximum length
    tensor_list = [pad_tensor(tensor, pad_token_id, max_len) for tensor in tensor_list]

    # return stacked tensors
    return torch.stack(tensor_list)


def gen_attention_mask(minibatch_encoding, max_len=None):
    if max_len is None:
        max_len = max(minibatch_encoding["length"])
    original_lens = minibatch_encoding["length"]
    attention_mask = [
        [1] * int(original_len) + [0] * (int(max_len) - int(original_len))
        for original_len in original_lens
    ]
    return torch.tensor(attention_mask).to(DEVICE)


# get cell embeddings excluding padding
def mean_nonpadding_embs(embs, original_lens):
    # mask based on padding lengths
    mask = torch.arange(embs.size(1)).unsqueeze(0).to(DEVICE) < original_lens.unsqueeze(1)

    # extend mask dimensions to match the embeddings tensor
    mask = mask.unsqueeze(2).expand_as(embs)

    # use the mask to zero out the embeddings in padded areas
    masked_embs = embs * mask.float()

    # sum and divide by the lengths to get the mean of non-padding embs
    mean_embs = masked_embs.sum(1) / original_lens.view(-1, 1).float()
    return mean_embs


# ---- geneformer/emb_extractor.py ----------------------------------------------------------------
# average embedding position of goal cell states
def get_embs(model, filtered_input_data, emb_mode, layer_to_quant, pad_token_id, forward_batch_size):
    model_input_size = get_model_input_size(model)
    total_batch_length = len(filtered_input_data)
    if ((total_batch_length - 1) / forward_batch_size).is_integer():
        forward_batch_size = forward_batch_size - 1

    embs_list = []
    for i in range(0, total_batch_length, forward_batch_size):
        max_range = min(i + forward_batch_size, total_batch_length)

        minibatch = filtered_input_data.select([i for i in range(i, max_range)])
        max_len = max(minibatch["length"])
        original_lens = torch.tensor(minibatch["length"]).to(DEVICE)
        minibatch.set_format(type="torch")

        input_data_minibatch = minibatch["input_ids"]
        input_data_minibatch = pad_tensor_list(
            input_data_minibatch, max_len, pad_token_id, model_input_size
        )

        with torch.no_grad():
            if FIXED:
                outputs = model(
                    input_ids=input_data_minibatch.to(DEVICE),
                    attention_mask=gen_attention_mask(minibatch),
                )
            else:
                outputs = model(input_ids=input_data_minibatch.to(DEVICE))

        embs_i = outputs.hidden_states[layer_to_quant]

        if emb_mode == "cell":
            mean_embs = mean_nonpadding_embs(embs_i, original_lens)
            embs_list += [mean_embs]

        del outputs
        del minibatch
        del input_data_minibatch
        del embs_i
        del mean_embs

    embs_stack = torch.cat(embs_list)
    return embs_stack


class EmbExtractor:
    def __init__(
        self,
        model_type="Pretrained",
        num_classes=0,
        emb_mode="cell",
        cell_emb_style="mean_pool",
        filter_data=None,
        max_ncells=1000,
        emb_layer=-1,
        emb_label=None,
        forward_batch_size=100,
        nproc=4,
        token_dictionary=None,
    ):
        self.model_type = model_type
        self.num_classes = num_classes
        self.emb_mode = emb_mode
        self.cell_emb_style = cell_emb_style
        self.filter_data = filter_data
        self.max_ncells = max_ncells
        self.emb_layer = emb_layer
        self.emb_label = emb_label
        self.forward_batch_size = forward_batch_size
        self.nproc = nproc
        self.gene_token_dict = token_dictionary
        self.pad_token_id = self.gene_token_dict.get("<pad>")

    def extract_embs(self, model_directory, input_data):
        downsampled_data = downsample_and_sort(input_data, self.max_ncells)
        model = load_model(self.model_type, self.num_classes, model_directory)
        layer_to_quant = quant_layers(model) + self.emb_layer
        embs = get_embs(
            model,
            downsampled_data,
            self.emb_mode,
            layer_to_quant,
            self.pad_token_id,
            self.forward_batch_size,
        )
        return embs, downsampled_data


def main():
    # token dictionary: <pad> 0, <mask> 1, then gene tokens
    token_dictionary = {"<pad>": 0, "<mask>": 1}
    token_dictionary.update({f"ENSG{i:011d}": i for i in range(2, 64)})

    # rank-value encoded cells (genes ordered by normalized expression), different lengths
    g = torch.Generator().manual_seed(1)
    cells = []
    for cell_id, n_genes in enumerate([7, 16, 11, 4, 13]):
        genes = (torch.randperm(62, generator=g)[:n_genes] + 2).tolist()
        cells.append({"cell_id": cell_id, "input_ids": genes, "length": n_genes})
    tokenized = CellDataset(cells)

    embex = EmbExtractor(
        model_type="Pretrained",
        emb_mode="cell",
        cell_emb_style="mean_pool",
        max_ncells=1000,
        emb_layer=-1,
        forward_batch_size=3,
        token_dictionary=token_dictionary,
    )
    embs, data = embex.extract_embs("path/to/model", tokenized)

    print("cell embeddings:", tuple(embs.shape))
    for row, cell_id, length in zip(embs, data["cell_id"], data["length"]):
        print(f"  cell {cell_id} ({length:2d} genes): {[round(v, 4) for v in row[:4].tolist()]}")


if __name__ == "__main__":
    main()
