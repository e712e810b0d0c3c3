# microsoft/ticl (MotherNet/TabPFN training code), commit d56c549 "pass efficient_eval_masking to assemble_model":
# get_model() never passed config['efficient_eval_masking'] to assemble_model(), so the TabPFN TransformerModel was
# built with the default False and used the D_q matrix (test rows also attend to themselves) instead of the
# configured train-only attention for test rows at single_eval_pos.
import sys
from functools import partial
from typing import Optional

import torch
from torch import nn, Tensor
from torch.nn import Module, MultiheadAttention, Linear, Dropout, LayerNorm

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---------------------------------------------------------------- tabpfn/utils.py
def bool_mask_to_att_mask(mask):
    return mask.float().masked_fill(mask == 0, float('-inf')).masked_fill(mask == 1, float(0.0))


# ---------------------------------------------------------------- tabpfn/encoders.py
class EncLinear(nn.Linear):  # encoders.Linear
    def __init__(self, num_features, emsize, replace_nan_by_zero=False):
        super().__init__(num_features, emsize)
        self.replace_nan_by_zero = replace_nan_by_zero

    def forward(self, x):
        if self.replace_nan_by_zero:
            x = torch.nan_to_num(x, nan=0.0)
        return super().forward(x)


# ---------------------------------------------------------------- tabpfn/layer.py
class TransformerEncoderLayer(Module):
    def __init__(self, d_model, nhead, dim_feedforward=2048, dropout=0.1, activation="relu",
                 layer_norm_eps=1e-5, batch_first=False, pre_norm=False, recompute_attn=False):
        super().__init__()
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout, batch_first=batch_first)
        self.linear1 = Linear(d_model, dim_feedforward)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(dim_feedforward, d_model)
        self.norm1 = LayerNorm(d_model, eps=layer_norm_eps)
        self.norm2 = LayerNorm(d_model, eps=layer_norm_eps)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)
        self.pre_norm = pre_norm
        self.recompute_attn = recompute_attn
        self.activation = nn.functional.gelu if activation == 'gelu' else nn.functional.relu

    def forward(self, src: Tensor, src_mask=None, src_key_padding_mask: Optional[Tensor] = None) -> Tensor:
        if self.pre_norm:
            src_ = self.norm1(src)
        else:
            src_ = src
        if isinstance(src_mask, int):
            assert src_key_padding_mask is None
            single_eval_position = src_mask
            src_left = self.self_attn(src_[:single_eval_position], src_[:single_eval_position], src_[:single_eval_position])[0]
            src_right = self.self_attn(src_[single_eval_position:], src_[:single_eval_position], src_[:single_eval_position])[0]
            src2 = torch.cat([src_left, src_right], dim=0)
        else:
            src2 = self.self_attn(src_, src_, src_, attn_mask=src_mask,
                                  key_padding_mask=src_key_padding_mask)[0]
        src = src + self.dropout1(src2)
        if not self.pre_norm:
            src = self.norm1(src)
        if self.pre_norm:
            src_ = self.norm2(src)
        else:
            src_ = src
        src2 = self.linear2(self.dropout(self.activation(self.linear1(src_))))
        src = src + self.dropout2(src2)
        if not self.pre_norm:
            src = self.norm2(src)
        return src


# ---------------------------------------------------------------- tabpfn/transformer.py
class TransformerEncoderDiffInit(Module):
    def __init__(self, encoder_layer_creator, num_layers, norm=None):
        super().__init__()
        self.layers = nn.ModuleList([encoder_layer_creator() for _ in range(num_layers)])
        self.num_layers = num_layers
        self.norm = norm

    def forward(self, src, mask=None, src_key_padding_mask=None):
        output = src
        for mod in self.layers:
            output = mod(output, src_mask=mask, src_key_padding_mask=src_key_padding_mask)
        if self.norm is not None:
            output = self.norm(output)
        return output


class TransformerModel(nn.Module):
    def __init__(self, encoder, n_out, ninp, nhead, nhid, nlayers, dropout=0.0, style_encoder=None, y_encoder=None,
                 pos_encoder=None, decoder=None, input_normalization=False, init_method=None, pre_norm=False,
                 activation='gelu', recompute_attn=False, num_global_att_tokens=0, full_attention=False,
                 all_layers_same_init=False, efficient_eval_masking=True):
        super().__init__()
        self.model_type = 'Transformer'
        encoder_layer_creator = lambda: TransformerEncoderLayer(ninp, nhead, nhid, dropout, activation=activation,
                                                                pre_norm=pre_norm, recompute_attn=recompute_attn)
        self.transformer_encoder = TransformerEncoderDiffInit(encoder_layer_creator, nlayers)
        self.ninp = ninp
        self.encoder = encoder
        self.y_encoder = y_encoder
        self.pos_encoder = pos_encoder
        self.decoder = nn.Sequential(nn.Linear(ninp, nhid), nn.GELU(), nn.Linear(nhid, n_out))
        self.input_ln = None
        self.style_encoder = style_encoder
        self.global_att_embeddings = None
        self.full_attention = full_attention
        self.efficient_eval_masking = efficient_eval_masking
        self.n_out = n_out
        self.nhid = nhid
        self.init_weights()

    @staticmethod
    def generate_D_q_matrix(sz, query_size):
        train_size = sz-query_size
        mask = torch.zeros(sz,sz) == 0
        mask[:,train_size:].zero_()
        mask |= torch.eye(sz) == 1
        return bool_mask_to_att_mask(mask)

    def init_weights(self):
        for layer in self.transformer_encoder.layers:
            nn.init.zeros_(layer.linear2.weight)
            nn.init.zeros_(layer.linear2.bias)
            nn.init.zeros_(layer.self_attn.out_proj.weight)
            nn.init.zeros_(layer.self_attn.out_proj.bias)

    def forward(self, src, src_mask=None, single_eval_pos=None):
        assert isinstance(src, tuple), 'inputs (src) have to be given as (x,y) or (style,x,y) tuple'
        if len(src) == 2:  # (x,y) and no style
            src = (None,) + src
        style_src, x_src, y_src = src
        x_src = self.encoder(x_src)
        y_src = self.y_encoder(y_src.unsqueeze(-1) if len(y_src.shape) < len(x_src.shape) else y_src)
        style_src = self.style_encoder(style_src).unsqueeze(0) if self.style_encoder else \
            torch.tensor([], device=x_src.device)
        global_src = torch.tensor([], device=x_src.device)

        if src_mask is None:
            full_len = len(x_src) + len(style_src)
            if self.full_attention:
                src_mask = bool_mask_to_att_mask(torch.ones((full_len, full_len), dtype=torch.bool)).to(x_src.device)
            elif self.efficient_eval_masking:
                src_mask = single_eval_pos + len(style_src)
            else:
                src_mask = self.generate_D_q_matrix(full_len, len(x_src) - single_eval_pos).to(x_src.device)

        train_x = x_src[:single_eval_pos] + y_src[:single_eval_pos]
        src = torch.cat([global_src, style_src, train_x, x_src[single_eval_pos:]], 0)
        output = self.transformer_encoder(src, src_mask)
        output = self.decoder(output)
        return output[single_eval_pos+len(style_src):]


# ---------------------------------------------------------------- tabpfn/assemble_model.py
def assemble_model(encoder_generator, num_features, emsize, nhead, nhid, nlayers, dropout, y_encoder, input_normalization,
                   model_maker, max_num_classes, efficient_eval_masking=False,
                   load_weights_from_this_state_dict=None, load_model_strict=True, verbose=False, pre_norm=False,
                   **model_extra_args):
    encoder = encoder_generator(num_features, emsize)
    n_out = max_num_classes if max_num_classes > 2 else 1
    model = TransformerModel(encoder, n_out, emsize, nhead, nhid, nlayers, dropout,
                             y_encoder=y_encoder, input_normalization=input_normalization,
                             efficient_eval_masking=efficient_eval_masking, pre_norm=pre_norm, **model_extra_args)
    if load_weights_from_this_state_dict is not None:
        model.load_state_dict(load_weights_from_this_state_dict, strict=load_model_strict)
    return model


# ---------------------------------------------------------------- tabpfn/scripts/model_builder.py (trimmed: no prior
# dataloader and epochs=0, i.e. the "load a checkpoint" use of get_model)
def get_encoder(config):
    return partial(EncLinear, replace_nan_by_zero=True)


def get_y_encoder(config):
    return EncLinear(1, emsize=config['emsize'])  # config['y_encoder'] == 'linear'


def get_model(config, device, should_train=True, verbose=False, state_dict=None, epoch_callback=None,
              load_model_strict=True):
    config['pre_norm'] = config['pre_norm'] if 'pre_norm' in config else False
    model_maker = config.get('model_maker', False)
    y_encoder = get_y_encoder(config)
    encoder = get_encoder(config)
    if FIXED:
        model = assemble_model(encoder_generator=encoder, y_encoder=y_encoder, num_features=config['num_features'],
                               emsize=config['emsize'], nhead=config['nhead'],
                               nhid=config['emsize'] * config['nhid_factor'], nlayers=config['nlayers'],
                               dropout=config['dropout'], input_normalization=config.get('input_normalization', False),
                               model_maker=model_maker, max_num_classes=config['max_num_classes'],
                               load_weights_from_this_state_dict=state_dict, load_model_strict=load_model_strict,
                               verbose=True, pre_norm=config['pre_norm'],
                               efficient_eval_masking=config.get('efficient_eval_masking', False))
    else:
        model = assemble_model(encoder_generator=encoder, y_encoder=y_encoder, num_features=config['num_features'],
                               emsize=config['emsize'], nhead=config['nhead'],
                               nhid=config['emsize'] * config['nhid_factor'], nlayers=config['nlayers'],
                               dropout=config['dropout'], input_normalization=config.get('input_normalization', False),
                               model_maker=model_maker, max_num_classes=config['max_num_classes'],
                               load_weights_from_this_state_dict=state_dict, load_model_strict=load_model_strict,
                               verbose=True, pre_norm=config['pre_norm'])
    model.to(device)
    model.eval()
    return model


# fit_model.py sets this; the model is meant to be trained and evaluated with train-only attention for test rows
config = dict(emsize=32, nhead=4, nhid_factor=2, nlayers=2, dropout=0.0, num_features=5, max_num_classes=3,
              model_maker=False, efficient_eval_masking=True)

# "checkpoint": a TransformerModel with the configured masking and non-zero (trained-like) weights
reference = TransformerModel(EncLinear(5, 32, replace_nan_by_zero=True), 3, 32, 4, 64, 2, 0.0,
                             y_encoder=EncLinear(1, 32), efficient_eval_masking=True)
with torch.no_grad():
    for p in reference.parameters():
        p.add_(0.3 * torch.randn_like(p))
reference.eval()
state_dict = reference.state_dict()

model = get_model(dict(config), 'cpu', should_train=False, state_dict=state_dict)
print("model.efficient_eval_masking =", model.efficient_eval_masking)

seq_len, batch, single_eval_pos = 20, 2, 12  # 12 train rows, 8 test rows, sequence-first layout
x = torch.randn(seq_len, batch, 5)
y = torch.randint(0, 3, (seq_len, batch)).float()
with torch.no_grad():
    out = model((x, y), single_eval_pos=single_eval_pos)
    ref = reference((x, y), single_eval_pos=single_eval_pos)
print(f"max |get_model output - model with the configured test-row mask|: {(out - ref).abs().max().item():.6e}")
