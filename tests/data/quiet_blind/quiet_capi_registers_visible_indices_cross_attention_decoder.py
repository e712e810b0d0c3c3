# Citation: facebookresearch/capi @0145b88f59828382b142a8d600e1f1e5e874698c: model.py (Mlp, Rope, Attention,
#   NaiveResidual / EfficientResidual, Block, Transformer, EncoderDecoder.prepare_tokens_and_drop /
#   get_edge_coordinates / forward_features / forward_pretrain / forward, _init_weights, OnlineClustering,
#   sinkhorn_knopp); data.py @43b3feb (UniformMasking, InverseBlockMasking, collate_data_and_cast);
#   train_capi.py @43b3feb (do_student, do_teacher). jaxtyping annotations dropped, OmegaConf config written as a
#   dict, L2NormLinear without weight_norm, sizes tiny.
# CAPI pretraining (a masked image model with registers): the collate function draws a boolean patch mask per crop
# and hands the model *flat batch indices* into [0, batch_size * n_tokens): visible_indices for the kept patches
# and predict_indices for a subsample of the masked ones. The encoder drops the masked patches by indexing the
# flattened (b * n) tokens, reshapes back to (b, n_visible, d) (every crop keeps the same count), and prepends the
# learned registers, whose RoPE coordinates sit on the edge of the visible box. No attention mask anywhere: the
# dropped patches are simply gone. The decoder is cross-attention only: one mask token per predicted patch,
# carrying that patch's coordinates, attends the encoder's registers + visible tokens; its outputs are flattened in
# predict_indices order, which is the order the teacher's targets are index_select-ed in.
import random
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

torch.manual_seed(0)
np.random.seed(0)
random.seed(0)


class Mlp(nn.Module):
    def __init__(self, in_features, hidden_features=None, mlp_ratio=4, bias=False):
        super().__init__()
        if hidden_features is None:
            assert mlp_ratio is not None
            hidden_features = int(in_features * mlp_ratio)
        else:
            assert mlp_ratio is None
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_features, in_features, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        x = self.fc1(x)
        x = self.act(x)
        x = self.fc2(x)
        return x


# from xformers
def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rope(nn.Module):
    def __init__(self, dim, max_freq=7, min_freq=7e-4):
        super().__init__()
        self.dim = dim
        self.max_freq = max_freq
        self.min_freq = min_freq
        self.freqs = nn.Parameter(torch.empty(2, self.dim))

    def _device_weight_init(self):
        # Create freqs in 1d
        freqs_1d = self.max_freq * (self.max_freq / self.min_freq) ** torch.linspace(0, -1, self.dim // 4)
        # duplicate freqs for rotation pairs of channels
        freqs_1d = torch.cat([freqs_1d, freqs_1d])
        # First half of channels do x, second half do y
        freqs_2d = torch.zeros(2, self.dim)
        freqs_2d[0, : self.dim // 2] = freqs_1d
        freqs_2d[1, -self.dim // 2 :] = freqs_1d
        # it's an angular freq here
        self.freqs.data.copy_(freqs_2d * 2 * torch.pi)

    def forward(self, x: Tensor, coords: Tensor) -> Tensor:
        angle = coords @ self.freqs
        return x * angle.cos() + rotate_half(x) * angle.sin()


class Attention(nn.Module):
    def __init__(self, dim, num_heads, qkv_bias=False, proj_bias=False, context_dim=None, rope_kwargs={}):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim = dim // num_heads
        context_dim = context_dim or dim

        self.q_proj = nn.Linear(dim, dim, bias=qkv_bias)
        self.k_proj = nn.Linear(context_dim, dim, bias=qkv_bias)
        self.v_proj = nn.Linear(context_dim, dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim, bias=proj_bias)
        self.rope = Rope(dim=head_dim, **rope_kwargs)

    def forward(self, x, coords, context=None, context_coords=None):
        if context is None or context_coords is None:
            context = x
            context_coords = coords
        b, n_q, d = x.shape
        b, n_k, _ = context.shape
        h = self.num_heads

        q = self.q_proj(x).reshape(b, n_q, h, d // h).transpose(1, 2)
        k = self.k_proj(context).reshape(b, n_k, h, d // h).transpose(1, 2)
        v = self.v_proj(context).reshape(b, n_k, h, d // h).transpose(1, 2)
        q = self.rope(q, coords[:, None, :, :])
        k = self.rope(k, context_coords[:, None, :, :])
        x = F.scaled_dot_product_attention(q, k, v)
        x = x.transpose(1, 2).reshape([b, n_q, d])
        x = self.proj(x)
        return x


class NaiveResidual(nn.Module):
    def __init__(self, drop_prob, norm, fn):
        super().__init__()
        self.norm = norm
        self.fn = fn
        self.keep_prob = 1 - drop_prob

    def forward(self, x, **kwargs):
        fn_out = self.fn(self.norm(x), **kwargs)
        if self.keep_prob == 1.0 or not self.training:
            return x + fn_out
        mask = fn_out.new_empty(x.shape[0]).bernoulli_(self.keep_prob)[:, None, None]
        return x + fn_out * mask / self.keep_prob


class EfficientResidual(NaiveResidual):
    def forward(self, x, **kwargs):
        if self.keep_prob == 1.0 or not self.training:
            return x + self.fn(self.norm(x), **kwargs)
        b, _, _ = x.shape
        n_keep = max(int(b * self.keep_prob), 1)
        indices = torch.randperm(b, device=x.device)[:n_keep]
        for k, v in kwargs.items():
            if v is not None:
                kwargs[k] = v[indices]
        return torch.index_add(
            x,
            dim=0,
            source=self.fn(self.norm(x[indices]), **kwargs),
            index=indices,
            alpha=b / n_keep,
        )


class Block(nn.Module):
    def __init__(self, dim, drop_path, norm_layer, context_dim, drop_path_type="efficient", attn_kwargs={}):
        super().__init__()
        residual_module = {
            "naive": NaiveResidual,
            "efficient": EfficientResidual,
        }[drop_path_type]
        self.residual1 = residual_module(
            drop_path,
            norm_layer(dim),
            Attention(
                dim,
                context_dim=context_dim,
                **attn_kwargs,
            ),
        )
        self.residual2 = residual_module(
            drop_path,
            norm_layer(dim),
            Mlp(in_features=dim),
        )

    def forward(self, x, context=None, coords=None, context_coords=None):
        x = self.residual1(
            x,
            context=context,
            coords=coords,
            context_coords=context_coords,
        )
        x = self.residual2(x)
        return x


class Transformer(nn.Module):
    def __init__(self, embed_dim, norm_layer, depth, drop_path_rate, context_dim=None, block_kwargs={}):
        super().__init__()
        self.embed_dim = embed_dim
        self.n_blocks = depth

        self.blocks = nn.ModuleList(
            [
                Block(
                    dim=embed_dim,
                    drop_path=drop_path_rate,
                    norm_layer=norm_layer,
                    context_dim=context_dim,
                    **block_kwargs,
                )
                for i in range(depth)
            ],
        )

    def forward(self, x, return_layers, contexts=None, coords=None, context_coords=None):
        outputs = {}
        if 0 in return_layers:
            outputs[0] = x
        for blk_idx, blk in enumerate(self.blocks):
            context = contexts[blk_idx] if contexts is not None else None
            x = blk(
                x,
                context=context,
                coords=coords,
                context_coords=context_coords,
            )
            if blk_idx + 1 in return_layers:
                outputs[blk_idx + 1] = x
        return outputs


class EncoderDecoder(nn.Module):
    def __init__(
        self,
        patch_size=14,
        in_chans=3,
        norm_layer_type="RMSNorm",
        n_registers=16,
        register_coordinates="edge",
        scale_reg_to_visible=True,
        transformers_kwargs={},
        encoder_kwargs={},
        decoder_kwargs={},
        norm_layer_kwargs={"eps": 1e-5},
        final_norm_kwargs={"elementwise_affine": False},
        out_layer=-1,
    ):
        super().__init__()
        self.patch_size = patch_size
        self.num_prefix_tokens = self.n_registers = n_registers
        self.register_coordinates = register_coordinates
        self.scale_reg_to_visible = scale_reg_to_visible

        norm_layer = partial(getattr(torch.nn, norm_layer_type), **norm_layer_kwargs)
        self.encoder = Transformer(
            **transformers_kwargs,
            **encoder_kwargs,
            norm_layer=norm_layer,
        )
        self.decoder = Transformer(
            **transformers_kwargs,
            **decoder_kwargs,
            context_dim=self.encoder.embed_dim,
            norm_layer=norm_layer,
        )
        self.embed_dim = self.encoder.embed_dim
        self.pred_dim = self.decoder.embed_dim
        self.n_blocks = len(self.encoder.blocks)
        self.out_layer = out_layer % (len(self.encoder.blocks) + 1)

        self.mask_token = nn.Parameter(torch.empty(1, self.decoder.embed_dim))
        self.registers = nn.Parameter(torch.empty(1, n_registers, self.encoder.embed_dim))
        self.patch_embed = nn.Conv2d(in_chans, self.encoder.embed_dim, kernel_size=patch_size, stride=patch_size)
        self.enc_norm = norm_layer(self.embed_dim, **final_norm_kwargs)
        self.dec_norm = norm_layer(self.decoder.embed_dim, **final_norm_kwargs)

    def init_weights(self):
        self.patch_embed.reset_parameters()
        w = self.patch_embed.weight.data
        torch.nn.init.xavier_uniform_(w.view([w.shape[0], -1]))
        nn.init.normal_(self.registers, std=0.02)
        nn.init.normal_(self.mask_token, std=0.02)
        self.apply(_init_weights)
        return self

    def prepare_tokens_and_drop(self, x, visible_indices):
        b, _, h, w = x.shape
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        # compute coord for ropes
        coord_x = torch.linspace(0, 1, h // self.patch_size, device=x.device, dtype=x.dtype)
        coord_y = torch.linspace(0, 1, w // self.patch_size, device=x.device, dtype=x.dtype)
        coords_all = torch.cartesian_prod(coord_x, coord_y)
        # Mask out
        coords_all = coords_all[None].expand(b, -1, -1)
        if visible_indices is not None:
            coords = coords_all.flatten(0, 1)[visible_indices].reshape(b, -1, 2)
            x = x.flatten(0, 1)[visible_indices].reshape(b, -1, self.embed_dim)
        else:
            coords = coords_all
        # add reg
        if self.register_coordinates == "zeros":
            reg_coords = torch.zeros(b, self.n_registers, 2, device=x.device, dtype=x.dtype)
        elif self.register_coordinates == "edge":
            reg_coords = self.get_edge_coordinates(self.n_registers, x.dtype, x.device).expand(b, -1, -1)
        else:
            raise ValueError(self.register_coordinates)
        if self.scale_reg_to_visible:
            mi, ma = coords.min(dim=1, keepdim=True).values, coords.max(dim=1, keepdim=True).values
            reg_coords = mi + reg_coords * (ma - mi)
        x = torch.cat([self.registers.expand(b, -1, -1), x], dim=1)
        coords = torch.cat([reg_coords, coords], dim=1)
        return x, coords, coords_all

    def get_edge_coordinates(self, n, dtype, device):
        side = n // 4
        assert n == 4 * side
        reg_coords = torch.zeros(1, n, 2, dtype=dtype, device=device)
        c = torch.arange(side, dtype=dtype, device=device) / side
        reg_coords[:, 0 * side : 1 * side, 0] = c
        reg_coords[:, 0 * side : 1 * side, 1] = 0
        reg_coords[:, 1 * side : 2 * side, 0] = 1
        reg_coords[:, 1 * side : 2 * side, 1] = c
        reg_coords[:, 2 * side : 3 * side, 0] = 1 - c
        reg_coords[:, 2 * side : 3 * side, 1] = 1
        reg_coords[:, 3 * side : 4 * side, 0] = 0
        reg_coords[:, 3 * side : 4 * side, 1] = 1 - c
        return reg_coords

    def forward_features(self, x, visible_indices, predict_indices, enc_layer, dec_layer):
        b, _, _, _ = x.shape
        # prepare and drop
        x, coords_enc, coords_all = self.prepare_tokens_and_drop(x, visible_indices)
        # these are the layers we need
        enc_layers = {enc_layer}
        if dec_layer is not None:
            enc_layers.add(len(self.encoder.blocks))
        # encoder fwd
        encoder_outputs = self.encoder(x, coords=coords_enc, return_layers=enc_layers)
        encoder_outputs = {k: self.enc_norm(v) for k, v in encoder_outputs.items()}
        # decoder fwd
        if dec_layer is not None:
            # if predict_indices is None, we use all positions
            coords_dec = coords_all.flatten(0, 1)[predict_indices].reshape(b, -1, 2)
            decoder_outputs = self.decoder(
                self.mask_token[None].expand(*coords_dec.shape[:2], -1),
                contexts=[encoder_outputs[len(self.encoder.blocks)]] * self.decoder.n_blocks,
                coords=coords_dec,
                context_coords=coords_enc,
                return_layers={dec_layer},
            )
            dec_out = self.dec_norm(decoder_outputs[dec_layer])
        else:
            dec_out = None
        enc_out = encoder_outputs[enc_layer]
        return (enc_out, dec_out)

    def forward_pretrain(self, x, visible_indices=None, predict_indices=None, do_prediction=False):
        """Used at train time"""
        encoder_output, decoder_output = self.forward_features(
            x,
            visible_indices,
            predict_indices,
            enc_layer=self.out_layer,
            dec_layer=len(self.decoder.blocks) if do_prediction else None,
        )
        if decoder_output is not None:
            decoder_output = decoder_output.flatten(0, 1)
        return encoder_output[:, self.num_prefix_tokens :], decoder_output

    def forward(self, x):
        """Used at eval time"""
        b, _, h, w = x.shape
        # uses `indices=None` to get all positions
        enc_out, dec_out = self.forward_features(x, None, None, enc_layer=self.out_layer, dec_layer=1)
        global_repr = dec_out.mean(dim=1)
        registers = enc_out[:, : self.num_prefix_tokens]
        feature_map = enc_out[:, self.num_prefix_tokens :].reshape(
            b,
            h // self.patch_size,
            w // self.patch_size,
            self.embed_dim,
        )
        return (global_repr, registers, feature_map)


# from https://github.com/facebookresearch/mae/blob/main/models_mae.py
def _init_weights(m, xavier_gain=1):
    if isinstance(m, nn.Linear):
        # we use xavier_uniform following official JAX ViT:
        torch.nn.init.xavier_uniform_(m.weight, gain=xavier_gain)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.constant_(m.bias, 0)
    elif isinstance(m, nn.LayerNorm | nn.RMSNorm) and m.elementwise_affine:
        nn.init.constant_(m.weight, 1.0)
        if hasattr(m, "bias") and m.bias is not None:
            nn.init.constant_(m.bias, 0)
    if hasattr(m, "_device_weight_init"):
        m._device_weight_init()


class L2NormLinear(nn.Module):
    def __init__(self, in_dim, out_dim):
        super().__init__()
        self.last_layer = nn.Linear(in_dim, out_dim, bias=False)
        nn.init.trunc_normal_(self.last_layer.weight, std=0.02)

    def forward(self, x):
        eps = 1e-6 if x.dtype == torch.float16 else 1e-12
        x = nn.functional.normalize(x, dim=-1, eps=eps)
        return self.last_layer(x)


exp_max_values = {torch.float16: 0, torch.float32: 50, torch.float64: 50, torch.bfloat16: 50}


def stable_exp(M):
    shift = M.max(dim=-2, keepdim=True).values
    M += exp_max_values[M.dtype] - shift
    return M.exp()


@torch.no_grad()
def sinkhorn_knopp(M, n_iterations, eps=1e-8):
    M = stable_exp(M)
    for _ in range(n_iterations):
        M /= torch.sum(M, dim=-2, keepdim=True) + eps
        M /= torch.sum(M, dim=-1, keepdim=True) + eps
    return M


class OnlineClustering(nn.Module):
    def __init__(self, in_dim, out_dim, *, bias, n_sk_iter, target_temp, pred_temp, positionwise_sk=True):
        super().__init__()
        self.out_dim = out_dim
        self.n_sk_iter = n_sk_iter
        self.target_temp = target_temp
        self.pred_temp = pred_temp
        self.positionwise_sk = positionwise_sk
        self.layer = nn.Linear(in_dim, out_dim, bias=bias)
        torch.nn.init.normal_(self.layer.weight, std=1)
        if bias:
            torch.nn.init.zeros_(self.layer.bias)

    def forward(self, x):
        x_n = nn.functional.normalize(x, dim=-1, p=2, eps=1e-7)
        logits = self.layer(x_n)
        if not self.positionwise_sk:
            sk_in = logits.flatten(0, -2)
        else:
            sk_in = logits
        assignments = sinkhorn_knopp(sk_in.detach() / self.target_temp, n_iterations=self.n_sk_iter)
        if not self.positionwise_sk:
            assignments = assignments.unflatten(0, logits.shape[:-1])

        tgt = assignments.flatten(0, -2).float()
        pred = logits.flatten(0, -2).float()
        loss = -torch.sum(tgt * F.log_softmax(pred / self.pred_temp, dim=-1), dim=-1).mean()
        return assignments.detach(), loss


# data.py

def random_boolean_array(n, k):
    arr = np.array([True] * k + [False] * (n - k))
    np.random.shuffle(arr)
    return arr


class UniformMasking:
    def __init__(self, input_size):
        self.height, self.width = input_size

    def __call__(self, num_masking_patches=0):
        mask = random_boolean_array(self.height * self.width, num_masking_patches)
        mask = mask.reshape((self.height, self.width))
        return mask


class BlockMasking:
    def __init__(self, input_size, roll=True, min_aspect=0.5, max_aspect=None):
        self.height, self.width = input_size
        self.roll = roll
        max_aspect = max_aspect or 1 / min_aspect
        self.log_aspect_ratio = (np.log(min_aspect), np.log(max_aspect))

    def __call__(self, num_masking_patches=0):
        if num_masking_patches == 0:
            return np.zeros((self.height, self.width), dtype=bool)
        # Sample aspect ratio, not too large or too small for image
        min_lar = max(self.log_aspect_ratio[0], np.log(num_masking_patches / (self.width**2)))
        max_lar = min(
            self.log_aspect_ratio[1],
            np.log(self.height**2 / (num_masking_patches + 1e-5)),
        )
        aspect_ratio = np.exp(random.uniform(min_lar, max_lar))
        # Use ceil so mask is >= num_masking_patches
        h = int(np.ceil(np.sqrt(num_masking_patches * aspect_ratio)))
        w = int(np.ceil(np.sqrt(num_masking_patches / aspect_ratio)))
        top = random.randint(0, self.height - h)
        left = random.randint(0, self.width - w)
        mask = np.zeros((self.height, self.width), dtype=bool)
        mask[top : top + h, left : left + w] = True
        # truncate ids to get exactly num_masking_patches
        ids = np.where(mask.flatten())[0][:num_masking_patches]
        mask = np.zeros((self.height, self.width), dtype=bool).flatten()
        mask[ids] = True
        mask = mask.reshape((self.height, self.width))
        if self.roll:
            shift_x = random.randint(0, mask.shape[0] - 1)
            shift_y = random.randint(0, mask.shape[1] - 1)
            mask = np.roll(mask, (shift_x, shift_y), (0, 1))
        return mask


class InverseBlockMasking(BlockMasking):
    def __call__(self, num_masking_patches=0):
        mask = super().__call__(self.height * self.width - num_masking_patches)
        return ~mask


mask_generators_dict = {
    "Uniform": UniformMasking,
    "Block": BlockMasking,
    "InverseBlock": InverseBlockMasking,
}


def collate_data_and_cast(samples_list, dtype, mask_ratio, n_tokens, mask_generator, prediction_subsampling):
    # Having all this in the collate_fn is a bit ugly
    n_crops = len(samples_list)
    n_masked = int(n_tokens * mask_ratio)
    n_predict = int(n_masked * prediction_subsampling)
    mask = torch.stack([torch.BoolTensor(mask_generator(n_masked)).flatten() for _ in range(n_crops)])
    # pred subsampling
    # predict_indices and mask_indices are *batch* indices, ie they are in [0, batch_size * n_tokens)
    mask_indices_abs = mask.flatten().nonzero().reshape(n_crops, -1)
    randperm = torch.argsort(torch.rand(n_crops, n_masked))[:, :n_predict]
    predict_indices_abs = torch.gather(mask_indices_abs, index=randperm, dim=1).flatten()
    return {
        "images": torch.stack([s[0] for s in samples_list]).to(dtype),
        "predict_indices": predict_indices_abs,
        "visible_indices": (~mask).flatten().nonzero().flatten(),
        "mask": mask,  # kept here for the checks below
    }


# train_capi.py

def do_student(model, images, predict_indices, visible_indices, target, temp):
    _, backbone_predictions = model.student.backbone.forward_pretrain(
        images,
        visible_indices=visible_indices,
        predict_indices=predict_indices,
        do_prediction=True,
    )
    pred = model.student.head(backbone_predictions)
    loss = -torch.sum(target.float() * F.log_softmax(pred.float() / temp, dim=-1), dim=-1)
    return loss.double().sum() / len(loss)


def do_teacher(model, images, predict_indices):
    with torch.set_grad_enabled(False):
        patch_before_head, _ = model.teacher.backbone.forward_pretrain(images)
    bs, n_visible, dim = patch_before_head.shape
    with torch.set_grad_enabled(True):
        patch_after_head, loss = model.teacher.head(patch_before_head.transpose(0, 1))
    with torch.set_grad_enabled(False):
        patch_after_head = patch_after_head.detach().transpose(0, 1)
        selected_patch_after_head = torch.index_select(
            patch_after_head.reshape(bs * n_visible, -1),
            dim=0,
            index=predict_indices,
        )
    return selected_patch_after_head, loss


cfg = {
    "model": {
        "patch_size": 4,
        "n_registers": 4,
        "transformers_kwargs": {
            "embed_dim": 32,
            "drop_path_rate": 0.0,
            "block_kwargs": {"attn_kwargs": {"num_heads": 4}},
        },
        "encoder_kwargs": {"depth": 2},
        "decoder_kwargs": {"depth": 2},
    },
    "capi": {
        "num_clusters": 16,
        "student_temp": 0.12,
        "clustering_kwargs": {"target_temp": 0.06, "pred_temp": 0.12, "n_sk_iter": 3, "bias": True},
    },
    "data": {"images_size": 24, "mask_ratio": 0.65, "prediction_subsampling": 0.5, "masking_generator": "InverseBlock"},
}


# ---- a hand-written reference: one sample at a time, one query at a time, keys by a boolean mask ----

def ref_attention(attn, x, coords, context, context_coords):
    """Double loop over heads and queries; x (n_q, d), context (n_k, d_k)."""
    h, hd = attn.num_heads, attn.head_dim
    q = attn.q_proj(x).reshape(-1, h, hd).transpose(0, 1)
    k = attn.k_proj(context).reshape(-1, h, hd).transpose(0, 1)
    v = attn.v_proj(context).reshape(-1, h, hd).transpose(0, 1)
    q = attn.rope(q, coords[None])
    k = attn.rope(k, context_coords[None])
    out = torch.zeros_like(q)
    for hh in range(h):
        for i in range(q.shape[1]):
            s = (k[hh] @ q[hh, i]) / hd**0.5
            out[hh, i] = torch.softmax(s, dim=0) @ v[hh]
    return attn.proj(out.transpose(0, 1).reshape(-1, h * hd))


def ref_block(blk, x, coords, context=None, context_coords=None):
    if context is None:  # encoder block: self-attention over registers + visible patches
        y = blk.residual1.norm(x)
        x = x + ref_attention(blk.residual1.fn, y, coords, y, coords)
    else:
        x = x + ref_attention(blk.residual1.fn, blk.residual1.norm(x), coords, context, context_coords)
    return x + blk.residual2.fn(blk.residual2.norm(x))


def ref_sample(backbone, image, keep, predict):
    """One image; keep: bool (n_tokens,) visible patches; predict: list of patch ids to predict, in order."""
    gh, gw = image.shape[1] // backbone.patch_size, image.shape[2] // backbone.patch_size
    tokens = backbone.patch_embed(image[None])[0].flatten(1).transpose(0, 1)
    grid = torch.stack(torch.meshgrid(torch.linspace(0, 1, gh), torch.linspace(0, 1, gw), indexing="ij"), -1)
    grid = grid.reshape(-1, 2)
    vis_coords = grid[keep]
    lo, hi = vis_coords.min(0).values, vis_coords.max(0).values
    reg = backbone.get_edge_coordinates(backbone.n_registers, tokens.dtype, tokens.device)[0]
    x = torch.cat([backbone.registers[0], tokens[keep]])
    coords = torch.cat([lo + reg * (hi - lo), vis_coords])
    for blk in backbone.encoder.blocks:
        x = ref_block(blk, x, coords)
    enc = backbone.enc_norm(x)
    preds = []
    for p in predict:  # each mask token alone: the decoder has no self-attention
        m = backbone.mask_token.clone()
        for blk in backbone.decoder.blocks:
            m = ref_block(blk, m, grid[p][None], enc, coords)
        preds.append(backbone.dec_norm(m)[0])
    preds = torch.stack(preds) if preds else enc.new_zeros(0, backbone.pred_dim)
    return enc[backbone.num_prefix_tokens :], preds


def main():
    img_size = cfg["data"]["images_size"]
    model = nn.ModuleDict({"student": nn.ModuleDict({}), "teacher": nn.ModuleDict({})})
    model.student["backbone"] = EncoderDecoder(**cfg["model"]).init_weights()
    model.teacher["backbone"] = EncoderDecoder(**cfg["model"])
    model.teacher.backbone.load_state_dict(model.student.backbone.state_dict())
    model.student["head"] = L2NormLinear(model.student.backbone.pred_dim, cfg["capi"]["num_clusters"])
    model.teacher["head"] = OnlineClustering(
        model.student.backbone.embed_dim, cfg["capi"]["num_clusters"], **cfg["capi"]["clustering_kwargs"]
    )
    model.teacher.backbone.requires_grad_(False)
    model.student.train()
    model.teacher.eval()

    patch_size = model.student.backbone.patch_size
    n_tokens = (img_size // patch_size) ** 2
    mask_generator = mask_generators_dict[cfg["data"]["masking_generator"]](
        input_size=(img_size // patch_size, img_size // patch_size), roll=True
    )
    collate_fn = partial(
        collate_data_and_cast,
        dtype=torch.float32,
        n_tokens=n_tokens,
        mask_generator=mask_generator,
        prediction_subsampling=cfg["data"]["prediction_subsampling"],
        mask_ratio=cfg["data"]["mask_ratio"],
    )
    optimizer = torch.optim.AdamW(model.student.parameters(), lr=1e-3)
    clustering_optimizer = torch.optim.AdamW(model.teacher.head.parameters(), lr=5e-4)

    bs = 3
    for it in range(3):
        data = collate_fn([(torch.randn(3, img_size, img_size), ()) for _ in range(bs)])
        optimizer.zero_grad(set_to_none=True)
        clustering_optimizer.zero_grad(set_to_none=True)
        targets, clustering_loss = do_teacher(model, data["images"], data["predict_indices"])
        clustering_loss.backward()
        capi_loss = do_student(
            model, data["images"], data["predict_indices"], data["visible_indices"], targets,
            cfg["capi"]["student_temp"],
        )
        capi_loss.backward()
        optimizer.step()
        clustering_optimizer.step()
        print(f"iter {it}: capi_loss {capi_loss.item():.4f} clustering_loss {clustering_loss.item():.4f}")
        assert torch.isfinite(capi_loss) and torch.isfinite(clustering_loss)

    # ---- checks against the per-sample reference ----
    backbone = model.student.backbone.eval()
    data = collate_fn([(torch.randn(3, img_size, img_size), ()) for _ in range(bs)])
    mask = data["mask"]
    n_masked = int(n_tokens * cfg["data"]["mask_ratio"])
    assert mask.sum(1).tolist() == [n_masked] * bs
    with torch.no_grad():
        enc_vis, dec = backbone.forward_pretrain(
            data["images"], data["visible_indices"], data["predict_indices"], do_prediction=True
        )
        n_predict = len(data["predict_indices"]) // bs
        dec = dec.reshape(bs, n_predict, -1)
        for b in range(bs):
            keep = ~mask[b]
            predict = (data["predict_indices"][b * n_predict : (b + 1) * n_predict] - b * n_tokens).tolist()
            assert all(mask[b, p] for p in predict)  # only masked patches are predicted
            ref_enc, ref_dec = ref_sample(backbone, data["images"][b], keep, predict)
            torch.testing.assert_close(enc_vis[b], ref_enc, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(dec[b], ref_dec, atol=1e-5, rtol=1e-5)

        # nothing dropped: the same model as the eval-time forward, registers first
        all_idx = torch.arange(bs * n_tokens)
        enc_all, _ = backbone.forward_pretrain(data["images"], all_idx, None)
        _, registers, feature_map = backbone(data["images"])
        torch.testing.assert_close(enc_all, feature_map.flatten(1, 2), atol=1e-5, rtol=1e-5)
        assert registers.shape[1] == backbone.n_registers
        full = torch.ones(n_tokens, dtype=torch.bool)
        for b in range(bs):
            ref_enc, _ = ref_sample(backbone, data["images"][b], full, [])
            torch.testing.assert_close(enc_all[b], ref_enc, atol=1e-5, rtol=1e-5)

        # the teacher's targets are taken at the same flat indices as the student's predictions
        teacher_out, _ = model.teacher.backbone.forward_pretrain(data["images"])
        picked = torch.index_select(teacher_out.reshape(bs * n_tokens, -1), 0, data["predict_indices"])
        for j, flat in enumerate(data["predict_indices"].tolist()):
            torch.testing.assert_close(picked[j], teacher_out[flat // n_tokens, flat % n_tokens])
    print("ok: batched flat-index dropping + registers + cross-attention decoder match the per-sample reference")


if __name__ == "__main__":
    main()
