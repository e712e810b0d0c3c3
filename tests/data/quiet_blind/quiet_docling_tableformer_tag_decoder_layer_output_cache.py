"""TableFormer's OTSL tag decoder (docling-ibm-models), shrunk: a table image to structure tags.

Ported from DS4SD/docling-ibm-models:
  docling_ibm_models/tableformer/models/table04_rs/transformer_rs.py
      @74343810af3b8168e55df3970236fa73a25e4ade
      (PositionalEncoding, TMTransformerDecoder, TMTransformerDecoderLayer, Tag_Transformer)
  docling_ibm_models/tableformer/models/table04_rs/tablemodel04_rs.py
      @0fb3ba0578942c045608ce38d4be77f2b4694d68 (TableModel04_rs.__init__ / predict, tag loop)
  docling_ibm_models/tableformer/models/table04_rs/encoder04_rs.py
      @7445296e6a4e9a92d64c14ca141bac845584785b (Encoder04)
  docling_ibm_models/tableformer/utils/utils.py (resnet_block)

Sequence-first, as TableFormer keeps it. The image memory is a fixed enc_image_size x
enc_image_size grid, so it has no padding: the encoder is handed an all-False bool mask of
shape (batch * n_heads, positions, positions), and predict passes the same tensor as
memory_key_padding_mask, which TMTransformerDecoder does not forward to its layers.

The decoder caches each layer's outputs: every step re-embeds all decoded tags, but each
TMTransformerDecoderLayer runs only the last tag as the query (attn_mask=None, since the
keys are the tags decoded so far) and the layer's input for the next layer is the cached
outputs of the earlier steps with this step's output appended.

Trimmed: torchvision's resnet18 / BasicBlock are written out small (no torchvision here),
sizes are tiny, and the bbox decoder and span-merge after the tag loop are left out; the
tag loop (with its OTSL structure corrections) and the hidden states it collects for the
bbox decoder are as the project writes them.

Checks: the encoder's output with its all-False mask against the encoder run without a
mask; every step's tag logits and every collected hidden state against a plain
nn.TransformerDecoderLayer forward over the whole decoded sequence with a causal tgt_mask
(no cache), for two table images predicted one after the other.
"""
import logging
import math
from typing import Optional

import torch
from torch import Tensor, nn

LOG_LEVEL = logging.WARN


def conv3x3(in_planes, out_planes, stride=1):
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes, out_planes, stride=1):
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    # torchvision.models.resnet.BasicBlock
    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x):
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


# Sizes: the project's resnet18 trunk ends at 256 channels and its hidden_dim is 512.
TRUNK_DIM = 16
HIDDEN_DIM = 32


def resnet_block(stride=1):
    layers = []
    downsample = nn.Sequential(
        conv1x1(TRUNK_DIM, HIDDEN_DIM, stride),
        nn.BatchNorm2d(HIDDEN_DIM),
    )
    layers.append(BasicBlock(TRUNK_DIM, HIDDEN_DIM, stride, downsample))
    layers.append(BasicBlock(HIDDEN_DIM, HIDDEN_DIM, 1))
    return nn.Sequential(*layers)


class Encoder04(nn.Module):
    """
    Encoder based on resnet-18 (its first layers, written small here)
    """

    def __init__(self, enc_image_size, enc_dim=512):
        super(Encoder04, self).__init__()
        self.enc_image_size = enc_image_size
        self._encoder_dim = enc_dim

        modules = [
            nn.Conv2d(3, TRUNK_DIM, kernel_size=7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(TRUNK_DIM),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
            BasicBlock(TRUNK_DIM, TRUNK_DIM),
            BasicBlock(TRUNK_DIM, TRUNK_DIM),
        ]
        self._resnet = nn.Sequential(*modules)
        self._adaptive_pool = nn.AdaptiveAvgPool2d((self.enc_image_size, self.enc_image_size))

    def get_encoder_dim(self):
        return self._encoder_dim

    def forward(self, images):
        out = self._resnet(images)  # (batch_size, 256, 28, 28) in the project
        out = self._adaptive_pool(out)
        out = out.permute(0, 2, 3, 1)  # (batch_size, enc_image_size, enc_image_size, 256)
        return out


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, dropout=0.1, max_len=1024):
        super(PositionalEncoding, self).__init__()
        self.dropout = nn.Dropout(p=dropout)

        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(
            torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model)
        )
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        pe = pe.unsqueeze(0).transpose(0, 1)
        self.register_buffer("pe", pe)

    def forward(self, x):
        x = x + self.pe[: x.size(0), :]
        return self.dropout(x)


class TMTransformerDecoder(nn.TransformerDecoder):
    def forward(
        self,
        tgt: Tensor,
        memory: Optional[Tensor] = None,
        cache: Optional[Tensor] = None,
        memory_mask: Optional[Tensor] = None,
        tgt_key_padding_mask: Optional[Tensor] = None,
        memory_key_padding_mask: Optional[Tensor] = None,
    ) -> Tensor:
        """
        Args:
            tgt (Tensor): encoded tags. (tags_len,bsz,hidden_dim)
            memory (Tensor): encoded image (enc_image_size,bsz,hidden_dim)
            cache (Optional[Tensor]): None during training, only used during inference.
        Returns:
            output (Tensor): (tags_len,bsz,hidden_dim)
        """

        output = tgt

        # cache
        tag_cache = []
        for i, mod in enumerate(self.layers):
            output = mod(output, memory)
            tag_cache.append(output)
            if cache is not None:
                output = torch.cat([cache[i], output], dim=0)

        if cache is not None:
            out_cache = torch.cat([cache, torch.stack(tag_cache, dim=0)], dim=1)
        else:
            out_cache = torch.stack(tag_cache, dim=0)

        return output, out_cache


class TMTransformerDecoderLayer(nn.TransformerDecoderLayer):
    def forward(
        self,
        tgt: Tensor,
        memory: Optional[Tensor] = None,
        memory_mask: Optional[Tensor] = None,
        tgt_key_padding_mask: Optional[Tensor] = None,
        memory_key_padding_mask: Optional[Tensor] = None,
    ) -> Tensor:
        """
        Args:
            same as TMTransformerDecoder
        Returns:
            Tensor:
                During training (seq_len,bsz,hidden_dim)
                If eval mode: embedding of last tag: (1,bsz,hidden_dim)
        """

        # From PyTorch but modified to only use the last tag
        tgt_last_tok = tgt[-1:, :, :]

        tmp_tgt = self.self_attn(
            tgt_last_tok,
            tgt,
            tgt,
            attn_mask=None,  # None, because we only care about the last tag
            key_padding_mask=tgt_key_padding_mask,
        )[0]
        tgt_last_tok = tgt_last_tok + self.dropout1(tmp_tgt)
        tgt_last_tok = self.norm1(tgt_last_tok)

        if memory is not None:
            tmp_tgt = self.multihead_attn(
                tgt_last_tok,
                memory,
                memory,
                attn_mask=memory_mask,
                key_padding_mask=memory_key_padding_mask,
            )[0]
            tgt_last_tok = tgt_last_tok + self.dropout2(tmp_tgt)
            tgt_last_tok = self.norm2(tgt_last_tok)

        tmp_tgt = self.linear2(self.dropout(self.activation(self.linear1(tgt_last_tok))))
        tgt_last_tok = tgt_last_tok + self.dropout3(tmp_tgt)
        tgt_last_tok = self.norm3(tgt_last_tok)
        return tgt_last_tok


class Tag_Transformer(nn.Module):
    """
    "Attention Is All You Need" - https://arxiv.org/abs/1706.03762
    """

    def __init__(
        self,
        device,
        vocab_size,
        td_encode,
        embed_dim,
        encoder_layers,
        decoder_layers,
        enc_image_size,
        dropout=0.1,
        n_heads=4,
        dim_ff=1024,
    ):
        super(Tag_Transformer, self).__init__()

        self._device = device
        self._n_heads = n_heads
        self._embedding = nn.Embedding(vocab_size, embed_dim)
        self._positional_encoding = PositionalEncoding(embed_dim)
        self._td_encode = td_encode

        encoder_layer = nn.TransformerEncoderLayer(
            d_model=embed_dim, nhead=n_heads, dim_feedforward=dim_ff
        )
        self._encoder = nn.TransformerEncoder(
            encoder_layer, num_layers=encoder_layers, enable_nested_tensor=False
        )

        self._decoder = TMTransformerDecoder(
            TMTransformerDecoderLayer(
                d_model=embed_dim,
                nhead=n_heads,
                dim_feedforward=dim_ff,
            ),
            num_layers=decoder_layers,
        )

        self._decoder_dim = embed_dim
        self._enc_image_size = enc_image_size
        self._input_filter = resnet_block(stride=1)
        self._fc = nn.Linear(embed_dim, vocab_size)


class TableModel04_rs(nn.Module):
    r"""
    TableNet04Model encoder, dual-decoder model with OTSL+ support (tag decoder here)
    """

    def __init__(self, config, init_data, purpose, device):
        super(TableModel04_rs, self).__init__()
        self._config = config
        self._init_data = init_data
        self._device = device
        word_map = init_data["word_map"]

        self._enc_image_size = config["model"]["enc_image_size"]
        self._encoder_dim = config["model"]["hidden_dim"]
        self._encoder = Encoder04(self._enc_image_size, self._encoder_dim).to(device)

        tag_vocab_size = len(word_map["word_map_tag"])

        td_encode = []
        for t in ["ecel", "fcel", "ched", "rhed", "srow"]:
            if t in word_map["word_map_tag"]:
                td_encode.append(word_map["word_map_tag"][t])

        self._decoder_dim = config["model"]["hidden_dim"]
        self._enc_layers = config["model"]["enc_layers"]
        self._dec_layers = config["model"]["dec_layers"]
        self._n_heads = config["model"]["nheads"]
        self._max_pred_len = config["predict"]["max_steps"]

        self._tag_transformer = Tag_Transformer(
            device,
            tag_vocab_size,
            td_encode,
            self._decoder_dim,
            self._enc_layers,
            self._dec_layers,
            self._enc_image_size,
            n_heads=self._n_heads,
            dim_ff=config["model"]["dim_ff"],
        ).to(device)

    def predict(self, imgs, max_steps, k, return_attention=False):
        r"""
        Inference. imgs: (1, 3, H, W), preprocessed.
        Returns the tag sequence and the tag hidden states kept for the bbox decoder.
        """
        # Invoke encoder
        self._tag_transformer.eval()
        enc_out = self._encoder(imgs)

        word_map = self._init_data["word_map"]["word_map_tag"]
        n_heads = self._tag_transformer._n_heads
        # [1, 28, 28, 512]
        encoder_out = self._tag_transformer._input_filter(enc_out.permute(0, 3, 1, 2)).permute(
            0, 2, 3, 1
        )

        batch_size = encoder_out.size(0)
        encoder_dim = encoder_out.size(-1)
        enc_inputs = encoder_out.view(batch_size, -1, encoder_dim).to(self._device)
        enc_inputs = enc_inputs.permute(1, 0, 2)
        positions = enc_inputs.shape[0]

        encoder_mask = torch.zeros(
            (batch_size * n_heads, positions, positions), device=self._device
        ) == torch.ones((batch_size * n_heads, positions, positions), device=self._device)

        # Invoking tag transformer encoder before the loop to save time
        encoder_out = self._tag_transformer._encoder(enc_inputs, mask=encoder_mask)

        decoded_tags = torch.LongTensor([word_map["<start>"]]).to(self._device).unsqueeze(1)
        output_tags = []
        cache = None
        tag_H_buf = []

        skip_next_tag = True
        prev_tag_ucel = False
        line_num = 0

        first_lcel = True
        bboxes_to_merge = {}
        cur_bbox_ind = -1
        bbox_ind = 0

        while len(output_tags) < self._max_pred_len:
            decoded_embedding = self._tag_transformer._embedding(decoded_tags)
            decoded_embedding = self._tag_transformer._positional_encoding(decoded_embedding)
            decoded, cache = self._tag_transformer._decoder(
                decoded_embedding,
                encoder_out,
                cache,
                memory_key_padding_mask=encoder_mask,
            )
            # Grab last feature to produce token
            logits = self._tag_transformer._fc(decoded[-1, :, :])  # 1, vocab_size
            new_tag = logits.argmax(1).item()

            # STRUCTURE ERROR CORRECTION
            # Correction for first line xcel...
            if line_num == 0:
                if new_tag == word_map["xcel"]:
                    new_tag = word_map["lcel"]

            # Correction for ucel, lcel sequence...
            if prev_tag_ucel:
                if new_tag == word_map["lcel"]:
                    new_tag = word_map["fcel"]

            # End of generation
            if new_tag == word_map["<end>"]:
                output_tags.append(new_tag)
                decoded_tags = torch.cat(
                    [decoded_tags, torch.LongTensor([new_tag]).unsqueeze(1).to(self._device)],
                    dim=0,
                )  # current_output_len, 1
                break
            output_tags.append(new_tag)

            # BBOX PREDICTION

            # MAKE SURE TO SYNC NUMBER OF CELLS WITH NUMBER OF BBOXes
            if not skip_next_tag:
                if new_tag in [
                    word_map["fcel"],
                    word_map["ecel"],
                    word_map["ched"],
                    word_map["rhed"],
                    word_map["srow"],
                    word_map["nl"],
                    word_map["ucel"],
                ]:
                    # GENERATE BBOX HERE TOO (All other cases)...
                    tag_H_buf.append(decoded[-1, :, :])
                    if first_lcel is not True:
                        # Mark end index for horizontal cell bbox merge
                        bboxes_to_merge[cur_bbox_ind] = bbox_ind
                    bbox_ind += 1

            # Treat horisontal span bboxes...
            if new_tag != word_map["lcel"]:
                first_lcel = True
            else:
                if first_lcel:
                    # GENERATE BBOX HERE (Beginning of horisontal span)...
                    tag_H_buf.append(decoded[-1, :, :])
                    first_lcel = False
                    # Mark start index for cell bbox merge
                    cur_bbox_ind = bbox_ind
                    bboxes_to_merge[cur_bbox_ind] = -1
                    bbox_ind += 1

            if new_tag in [word_map["nl"], word_map["ucel"], word_map["xcel"]]:
                skip_next_tag = True
            else:
                skip_next_tag = False

            # Register ucel in sequence...
            if new_tag == word_map["ucel"]:
                prev_tag_ucel = True
            else:
                prev_tag_ucel = False

            decoded_tags = torch.cat(
                [decoded_tags, torch.LongTensor([new_tag]).unsqueeze(1).to(self._device)],
                dim=0,
            )  # current_output_len, 1
        seq = decoded_tags.squeeze().tolist()
        return seq, tag_H_buf, bboxes_to_merge


# ----------------------------------------------------------------------------------------
# Reference (written here): the same weights run as plain nn.TransformerEncoder /
# nn.TransformerDecoderLayer forwards, no cache, the whole tag sequence at once.
# ----------------------------------------------------------------------------------------


@torch.no_grad()
def reference_memory(model, img):
    tt = model._tag_transformer
    enc_out = model._encoder(img)
    x = tt._input_filter(enc_out.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
    x = x.reshape(1, -1, x.size(-1)).permute(1, 0, 2)
    return tt._encoder(x)


@torch.no_grad()
def reference_decode(model, memory, tags):
    """All positions of `tags` (a list of ids) at once, with a causal tgt_mask."""
    tt = model._tag_transformer
    ids = torch.tensor(tags, dtype=torch.long).unsqueeze(1)  # (T, 1)
    x = tt._positional_encoding(tt._embedding(ids))
    T = x.size(0)
    causal = torch.triu(torch.full((T, T), float("-inf")), diagonal=1)
    for layer in tt._decoder.layers:
        x = nn.TransformerDecoderLayer.forward(layer, x, memory, tgt_mask=causal)
    return x[:, 0, :], tt._fc(x[:, 0, :])  # (T, D), (T, vocab)


def main():
    torch.manual_seed(14)
    device = torch.device("cpu")
    word_map_tag = {
        "<pad>": 0, "<unk>": 1, "<start>": 2, "<end>": 3,
        "ecel": 4, "fcel": 5, "lcel": 6, "ucel": 7, "xcel": 8, "nl": 9,
        "ched": 10, "rhed": 11, "srow": 12,
    }
    config = {
        "model": {
            "enc_image_size": 4, "hidden_dim": HIDDEN_DIM, "enc_layers": 2, "dec_layers": 2,
            "nheads": 4, "dim_ff": 64,
        },
        "predict": {"max_steps": 24},
    }
    init_data = {"word_map": {"word_map_tag": word_map_tag}}
    model = TableModel04_rs(config, init_data, "predict", device)
    model.eval()
    step_logits = []
    hook = model._tag_transformer._fc.register_forward_hook(
        lambda mod, inp, out: step_logits.append(out.detach().clone())
    )

    tables = [torch.randn(1, 3, 64, 64), torch.randn(1, 3, 64, 48)]
    for n, img in enumerate(tables):
        step_logits.clear()
        with torch.no_grad():
            seq, tag_H_buf, bboxes_to_merge = model.predict(img, max_steps=24, k=1)
        predicted_logits = list(step_logits)

        memory = reference_memory(model, img)
        ref_hidden, ref_logits = reference_decode(model, memory, seq)

        # The project's masked encoder against the same encoder without a mask.
        tt = model._tag_transformer
        with torch.no_grad():
            enc_out = model._encoder(img)
            x = tt._input_filter(enc_out.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
            x = x.reshape(1, -1, x.size(-1)).permute(1, 0, 2)
            P = x.size(0)
            all_false = torch.zeros((tt._n_heads, P, P), dtype=torch.bool)
            torch.testing.assert_close(tt._encoder(x, mask=all_false), memory)

        # Step s's logits come from the last of s + 1 tags (start + s decoded).
        assert len(predicted_logits) == len(seq) - 1, (len(predicted_logits), len(seq))
        for s, lg in enumerate(predicted_logits):
            torch.testing.assert_close(lg[0], ref_logits[s], rtol=1e-4, atol=1e-5)

        # Hidden states kept for the bbox decoder: the step's last hidden state.
        kept = [h[0] for h in tag_H_buf]
        for h in kept:
            dist = (ref_hidden - h).abs().amax(dim=-1)
            assert dist.min().item() < 1e-4, dist.min().item()

        cells = seq.count(word_map_tag["ecel"]) + seq.count(word_map_tag["fcel"])
        rows = seq.count(word_map_tag["nl"])
        print(
            f"table {n}: {len(seq)} tags, {cells} cells, {rows} rows, "
            f"{len(tag_H_buf)} bbox hidden states, spans {bboxes_to_merge}"
        )
        print("  tags:", seq)
    hook.remove()
    print("OK: cached tag decoding matches the uncached causal decoder at every step")


if __name__ == "__main__":
    main()
