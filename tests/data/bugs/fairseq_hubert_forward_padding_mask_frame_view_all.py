# facebookresearch/fairseq#3572 ("[Hubert] Fix padding mask", the HuBERT copy of #3228 for issue #3227;
# closed without merge, fairseq/models/hubert/hubert.py still has the old code, so `--fixed` applies the PR's diff).
# HubertModel.forward_padding_mask turns the sample-level padding mask into a frame-level one by cutting the
# samples into features.size(1) equal slices and calling a frame padding only if its whole slice is padding. The
# conv feature extractor's real frame count for a row comes from its kernel/stride formula, not from that slice
# width, so a short row next to a long one keeps a frame computed from padded samples as a real key of the
# encoder's self-attention. The fix computes each row's frame length with _get_feat_extract_output_lengths and
# builds the frame padding mask from it.
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class HubertConfig:
    # extractor_mode "layer_norm" (HuBERT Large / X-Large): no GroupNorm over time in the feature extractor
    extractor_mode = "layer_norm"
    conv_feature_layers = "[(32, 10, 5)] + [(32, 3, 2)] + [(32, 2, 2)]"
    conv_bias = False
    encoder_embed_dim = 32
    encoder_ffn_embed_dim = 64
    encoder_attention_heads = 4
    encoder_layers = 2
    layer_norm_first = True
    final_dim = 16
    num_classes = 12


class ConvFeatureExtractionModel(nn.Module):
    def __init__(self, conv_layers, mode="layer_norm", conv_bias=False):
        super().__init__()

        def block(n_in, n_out, k, stride):
            return nn.Sequential(
                nn.Conv1d(n_in, n_out, k, stride=stride, bias=conv_bias),
                TransposeLast(),
                nn.LayerNorm(n_out, elementwise_affine=True),
                TransposeLast(),
                nn.GELU(),
            )

        in_d = 1
        self.conv_layers = nn.ModuleList()
        for dim, k, stride in conv_layers:
            self.conv_layers.append(block(in_d, dim, k, stride))
            in_d = dim

    def forward(self, x):
        # BxT -> BxCxT
        x = x.unsqueeze(1)
        for conv in self.conv_layers:
            x = conv(x)
        return x


class TransposeLast(nn.Module):
    def forward(self, x):
        return x.transpose(-2, -1)


class TransformerSentenceEncoderLayer(nn.Module):
    def __init__(self, embed_dim, ffn_dim, heads, layer_norm_first):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(embed_dim, heads)
        self.self_attn_layer_norm = nn.LayerNorm(embed_dim)
        self.fc1 = nn.Linear(embed_dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, embed_dim)
        self.final_layer_norm = nn.LayerNorm(embed_dim)
        self.layer_norm_first = layer_norm_first

    def forward(self, x, self_attn_padding_mask=None):
        # x: T x B x C
        residual = x
        x = self.self_attn_layer_norm(x)
        x, attn = self.self_attn(x, x, x, key_padding_mask=self_attn_padding_mask, need_weights=False)
        x = residual + x
        residual = x
        x = self.final_layer_norm(x)
        x = self.fc2(F.gelu(self.fc1(x)))
        x = residual + x
        return x, attn


class TransformerEncoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.pos_conv = nn.Conv1d(cfg.encoder_embed_dim, cfg.encoder_embed_dim, kernel_size=5, padding=2, groups=4)
        self.layers = nn.ModuleList(
            [
                TransformerSentenceEncoderLayer(
                    cfg.encoder_embed_dim, cfg.encoder_ffn_embed_dim, cfg.encoder_attention_heads, cfg.layer_norm_first
                )
                for _ in range(cfg.encoder_layers)
            ]
        )
        self.layer_norm = nn.LayerNorm(cfg.encoder_embed_dim)
        self.layer_norm_first = cfg.layer_norm_first

    def forward(self, x, padding_mask=None, layer=None):
        x, layer_results = self.extract_features(x, padding_mask, layer)
        if self.layer_norm_first and layer is None:
            x = self.layer_norm(x)
        return x, layer_results

    def extract_features(self, x, padding_mask=None, tgt_layer=None):
        if padding_mask is not None:
            x[padding_mask] = 0

        x_conv = F.gelu(self.pos_conv(x.transpose(1, 2))).transpose(1, 2)
        x = x + x_conv

        # B x T x C -> T x B x C
        x = x.transpose(0, 1)
        layer_results = []
        for i, layer in enumerate(self.layers):
            x, z = layer(x, self_attn_padding_mask=padding_mask)
            layer_results.append(x)
            if i == tgt_layer:
                break
        # T x B x C -> B x T x C
        x = x.transpose(0, 1)
        return x, layer_results


class HubertModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        feature_enc_layers = eval(cfg.conv_feature_layers)
        self.embed = feature_enc_layers[-1][0]
        self.feature_extractor = ConvFeatureExtractionModel(
            conv_layers=feature_enc_layers, mode=cfg.extractor_mode, conv_bias=cfg.conv_bias
        )
        self.conv_feature_layers = cfg.conv_feature_layers
        self.post_extract_proj = (
            nn.Linear(self.embed, cfg.encoder_embed_dim) if self.embed != cfg.encoder_embed_dim else None
        )
        self.dropout_input = nn.Dropout(0.0)
        self.encoder = TransformerEncoder(cfg)
        self.layer_norm = nn.LayerNorm(self.embed)
        self.final_proj = nn.Linear(cfg.encoder_embed_dim, cfg.final_dim)
        self.label_embs_concat = nn.Parameter(torch.randn(cfg.num_classes, cfg.final_dim))

    def forward_features(self, source):
        with torch.no_grad():
            features = self.feature_extractor(source)
        return features

    def _get_feat_extract_output_lengths(self, input_lengths):
        """
        Computes the output length of the convolutional layers
        """

        def _conv_out_length(input_length, kernel_size, stride):
            return torch.floor((input_length - kernel_size) / stride + 1)

        conv_cfg_list = eval(self.conv_feature_layers)

        for i in range(len(conv_cfg_list)):
            input_lengths = _conv_out_length(input_lengths, conv_cfg_list[i][1], conv_cfg_list[i][2])

        return input_lengths.to(torch.long)

    def forward_padding_mask(self, features, padding_mask):
        if FIXED:
            input_lengths = (1 - padding_mask.long()).sum(-1)
            # apply conv formula to get real output_lengths
            output_lengths = self._get_feat_extract_output_lengths(input_lengths)

            padding_mask = torch.zeros(features.shape[:2], dtype=features.dtype, device=features.device)

            # these two operations makes sure that all values
            # before the output lengths indices are attended to
            padding_mask[(torch.arange(padding_mask.shape[0], device=padding_mask.device), output_lengths - 1)] = 1
            padding_mask = (1 - padding_mask.flip([-1]).cumsum(-1).flip([-1])).bool()
            return padding_mask
        extra = padding_mask.size(1) % features.size(1)
        if extra > 0:
            padding_mask = padding_mask[:, :-extra]
        padding_mask = padding_mask.view(padding_mask.size(0), features.size(1), -1)
        padding_mask = padding_mask.all(-1)
        return padding_mask

    def forward(self, source, padding_mask=None, mask=False, features_only=True, output_layer=None):
        features = self.forward_features(source)
        features = features.transpose(1, 2)
        features = self.layer_norm(features)

        if padding_mask is not None:
            padding_mask = self.forward_padding_mask(features, padding_mask)

        if self.post_extract_proj is not None:
            features = self.post_extract_proj(features)

        x = self.dropout_input(features)
        x, _ = self.encoder(x, padding_mask=padding_mask, layer=None if output_layer is None else output_layer - 1)
        return {"x": x, "padding_mask": padding_mask, "features": features}

    def extract_features(self, source, padding_mask=None, mask=False, ret_conv=False, output_layer=None):
        res = self.forward(source, padding_mask=padding_mask, mask=mask, features_only=True, output_layer=output_layer)
        feature = res["features"] if ret_conv else res["x"]
        return feature, res["padding_mask"]


def collate(wavs):
    # fairseq's RawAudioDataset.collater: right-pad with zeros, padding_mask True on the padded samples
    size = max(w.size(0) for w in wavs)
    collated = wavs[0].new_zeros(len(wavs), size)
    padding_mask = torch.BoolTensor(collated.shape).fill_(False)
    for i, w in enumerate(wavs):
        diff = w.size(0) - size
        if diff == 0:
            collated[i] = w
        else:
            collated[i] = torch.cat([w, w.new_full((-diff,), 0.0)])
            padding_mask[i, diff:] = True
    return {"source": collated, "padding_mask": padding_mask}


def main():
    cfg = HubertConfig()
    model = HubertModel(cfg).eval()

    wavs = [torch.randn(400), torch.randn(260)]
    batch = collate(wavs)

    with torch.no_grad():
        x, frame_padding_mask = model.extract_features(batch["source"], padding_mask=batch["padding_mask"])
        # unit prediction on each utterance's real frames (as the k-means / HuBERT unit labelling scripts do)
        proj = model.final_proj(x)
        logits = torch.cosine_similarity(
            proj.unsqueeze(2), model.label_embs_concat.view(1, 1, cfg.num_classes, -1), dim=-1
        )
        units = logits.argmax(-1)

    for i in range(len(wavs)):
        n = int((~frame_padding_mask[i]).sum())
        print(f"utt {i}: {n} frames, units {units[i, :n].tolist()}")
        print(f"utt {i}: mean feature of real frames {x[i, :n].mean(0)[:4].tolist()}")


if __name__ == "__main__":
    main()
