# Citation: bytedance/GR-1 @0974aa00805b712d38afee82090047235097d0a1: models/gr1.py (GR1.forward: token layout
#   [lang, state, patch latents, obs, hand patch latents, hand obs, ACT] per timestep, stacked_attention_mask),
#   models/trajectory_gpt2.py (the Decision-Transformer GPT2 without position embeddings: Attention._attn with the
#   `bias` tril buffer and masked_bias -1e4, GPT2Model.forward's (1 - mask) * -10000 key mask), and
#   evaluation/calvin_evaluation.py (GR1CalvinEvaluation.step: a history buffer of at most seq_len frames, copied
#   to the front of zero tensors, attention_mask[0, :buffer_len] = 1, the last valid action is taken).
# GR-1 reads a right-padded window of timesteps. Each timestep holds 1 + 1 + n_latents + 1 + n_latents + 1 input
# tokens and one [ACT] query token; the per-timestep mask is repeated over the input tokens and a column of zeros is
# appended for the [ACT] token, so no token ever attends to an [ACT] query (the query reads the causal past only) and
# no token attends to padded timesteps. The GPT2 adds the causal tril and the (1 - mask) * -10000 key mask.
# Trimmed: CLIP's text encoder, the MAE ViT and flamingo_pytorch's PerceiverResampler are tiny stand-ins written
# here (they see no padding), and the forward-prediction decoder is left out (the CALVIN evaluation builds GR1 with
# training_target=['act_pred']); `.cuda()` on the query mask is replaced by the input's device.
# Self-check: (1) a batch of two right-padded windows, (2) the CALVIN step loop as the buffer fills and then slides:
# every valid timestep's action equals a reference that embeds only the valid timesteps (no padding, no mask) and
# runs the GPT with a double loop whose keys are the earlier non-[ACT] tokens, and padded frames filled with noise
# change nothing.
import torch
import torch.nn as nn
import torch.nn.functional as F

import transformers
from transformers.activations import ACT2FN
from transformers.pytorch_utils import Conv1D

torch.manual_seed(0)


# ---------------- models/trajectory_gpt2.py (trimmed) ----------------
class Attention(nn.Module):
    def __init__(self, nx, n_ctx, config, scale=False, is_cross_attention=False):
        super().__init__()

        n_state = nx  # in Attention: n_state=768 (nx=n_embd)
        assert n_state % config.n_head == 0
        self.register_buffer(
            "bias", torch.tril(torch.ones((n_ctx, n_ctx), dtype=torch.uint8)).view(1, 1, n_ctx, n_ctx)
        )
        self.register_buffer("masked_bias", torch.tensor(-1e4))
        self.n_head = config.n_head
        self.split_size = n_state
        self.scale = scale
        self.is_cross_attention = is_cross_attention
        self.c_attn = Conv1D(3 * n_state, nx)
        self.c_proj = Conv1D(n_state, nx)
        self.attn_dropout = nn.Dropout(config.attn_pdrop)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)

    def _attn(self, q, k, v, attention_mask=None, head_mask=None, output_attentions=False):
        w = torch.matmul(q, k)
        if self.scale:
            w = w / (float(v.size(-1)) ** 0.5)
        nd, ns = w.size(-2), w.size(-1)

        if not self.is_cross_attention:
            # if only "normal" attention layer implements causal mask
            mask = self.bias[:, :, ns - nd: ns, :ns]
            w = torch.where(mask.bool(), w, self.masked_bias.to(w.dtype))

        if attention_mask is not None:
            # Apply the attention mask
            w = w + attention_mask

        w = nn.Softmax(dim=-1)(w)
        w = self.attn_dropout(w)

        # Mask heads if we want to
        if head_mask is not None:
            w = w * head_mask

        outputs = [torch.matmul(w, v)]
        if output_attentions:
            outputs.append(w)
        return outputs

    def merge_heads(self, x):
        x = x.permute(0, 2, 1, 3).contiguous()
        new_x_shape = x.size()[:-2] + (x.size(-2) * x.size(-1),)
        return x.view(*new_x_shape)  # in Tensorflow implem: fct merge_states

    def split_heads(self, x, k=False):
        new_x_shape = x.size()[:-1] + (self.n_head, x.size(-1) // self.n_head)
        x = x.view(*new_x_shape)  # in Tensorflow implem: fct split_states
        if k:
            return x.permute(0, 2, 3, 1)  # (batch, head, head_features, seq_length)
        else:
            return x.permute(0, 2, 1, 3)  # (batch, head, seq_length, head_features)

    def forward(self, hidden_states, layer_past=None, attention_mask=None, head_mask=None,
                use_cache=False, output_attentions=False):
        query, key, value = self.c_attn(hidden_states).split(self.split_size, dim=2)

        query = self.split_heads(query)
        key = self.split_heads(key, k=True)
        value = self.split_heads(value)
        present = (None,)

        attn_outputs = self._attn(query, key, value, attention_mask, head_mask, output_attentions)
        a = attn_outputs[0]

        a = self.merge_heads(a)
        a = self.c_proj(a)
        a = self.resid_dropout(a)

        outputs = [a, present] + attn_outputs[1:]
        return outputs  # a, present, (attentions)


class MLP(nn.Module):
    def __init__(self, n_state, config):  # in MLP: n_state=3072 (4 * n_embd)
        super().__init__()
        nx = config.n_embd
        self.c_fc = Conv1D(n_state, nx)
        self.c_proj = Conv1D(nx, n_state)
        self.act = ACT2FN[config.activation_function]
        self.dropout = nn.Dropout(config.resid_pdrop)

    def forward(self, x):
        h = self.act(self.c_fc(x))
        h2 = self.c_proj(h)
        return self.dropout(h2)


class Block(nn.Module):
    def __init__(self, n_ctx, config, scale=False):
        super().__init__()
        hidden_size = config.n_embd
        inner_dim = config.n_inner if config.n_inner is not None else 4 * hidden_size
        self.ln_1 = nn.LayerNorm(hidden_size, eps=config.layer_norm_epsilon)
        self.attn = Attention(hidden_size, n_ctx, config, scale)
        self.ln_2 = nn.LayerNorm(hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = MLP(inner_dim, config)

    def forward(self, hidden_states, layer_past=None, attention_mask=None, head_mask=None,
                use_cache=False, output_attentions=False):
        attn_outputs = self.attn(
            self.ln_1(hidden_states),
            layer_past=layer_past,
            attention_mask=attention_mask,
            head_mask=head_mask,
            use_cache=use_cache,
            output_attentions=output_attentions,
        )
        attn_output = attn_outputs[0]  # output_attn: a, present, (attentions)
        outputs = attn_outputs[1:]
        # residual connection
        hidden_states = attn_output + hidden_states

        feed_forward_hidden_states = self.mlp(self.ln_2(hidden_states))
        # residual connection
        hidden_states = hidden_states + feed_forward_hidden_states

        outputs = [hidden_states] + outputs
        return outputs  # hidden_states, present, (attentions, cross_attentions)


class GPT2Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        # self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.drop = nn.Dropout(config.embd_pdrop)
        self.h = nn.ModuleList([Block(config.n_positions, config, scale=True) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding, Conv1D)):
            module.weight.data.normal_(mean=0.0, std=self.config.initializer_range)
            if isinstance(module, (nn.Linear, Conv1D)) and module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.LayerNorm):
            module.bias.data.zero_()
            module.weight.data.fill_(1.0)

    @property
    def dtype(self):
        return self.ln_f.weight.dtype

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None):
        input_shape = inputs_embeds.size()[:-1]
        batch_size = inputs_embeds.shape[0]

        # Attention mask.
        if attention_mask is not None:
            assert batch_size > 0, "batch_size has to be defined and > 0"
            attention_mask = attention_mask.view(batch_size, -1)
            # We create a 3D attention mask from a 2D tensor mask.
            # Sizes are [batch_size, 1, 1, to_seq_length]
            attention_mask = attention_mask[:, None, None, :]

            # Since attention_mask is 1.0 for positions we want to attend and 0.0 for
            # masked positions, this operation will create a tensor which is 0.0 for
            # positions we want to attend and -10000.0 for masked positions.
            attention_mask = attention_mask.to(dtype=self.dtype)  # fp16 compatibility
            attention_mask = (1.0 - attention_mask) * -10000.0

        # position_embeds = self.wpe(position_ids)
        hidden_states = inputs_embeds  # + position_embeds
        hidden_states = self.drop(hidden_states)

        output_shape = input_shape + (hidden_states.size(-1),)

        for i, block in enumerate(self.h):
            outputs = block(hidden_states, layer_past=None, attention_mask=attention_mask, head_mask=None)
            hidden_states, present = outputs[:2]

        hidden_states = self.ln_f(hidden_states)
        hidden_states = hidden_states.view(*output_shape)
        return {'last_hidden_state': hidden_states}


# ---------------- stand-ins for CLIP, the MAE ViT and flamingo_pytorch's PerceiverResampler ----------------
class TinyClip(nn.Module):
    """encode_text as CLIP does: the feature at the EOT token (the largest token id) of a 0-padded prompt."""

    def __init__(self, vocab=50, width=24, embed_dim=16):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.text_projection = nn.Parameter(torch.randn(width, embed_dim) * 0.2)

    def encode_text(self, text):
        x = torch.tanh(self.mix(self.token_embedding(text).cumsum(dim=1)))  # causal summary, as a stand-in
        x = x[torch.arange(x.shape[0]), text.argmax(dim=-1)] @ self.text_projection
        return x


class TinyMAE(nn.Module):
    """Returns (cls feature, patch features) per image, like GR-1's MAE ViT with num_classes=0."""

    def __init__(self, patch=4, img_feat_dim=20, patch_feat_dim=12):
        super().__init__()
        self.patch = patch
        self.patch_embed = nn.Linear(3 * patch * patch, patch_feat_dim)
        self.head = nn.Linear(patch_feat_dim, img_feat_dim)

    def forward(self, x):
        n, c, h, w = x.shape
        p = self.patch
        x = x.reshape(n, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(n, (h // p) * (w // p), c * p * p)
        patches = torch.tanh(self.patch_embed(x))
        return self.head(patches.mean(dim=1)), patches


class PerceiverAttention(nn.Module):
    def __init__(self, dim, dim_head=8, heads=2):
        super().__init__()
        self.scale = dim_head ** -0.5
        self.heads = heads
        inner_dim = dim_head * heads
        self.norm_media = nn.LayerNorm(dim)
        self.norm_latents = nn.LayerNorm(dim)
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim, inner_dim * 2, bias=False)
        self.to_out = nn.Linear(inner_dim, dim, bias=False)

    def forward(self, x, latents):
        x = self.norm_media(x)
        latents = self.norm_latents(latents)
        b, m, n, d = x.shape
        h = self.heads
        q = self.to_q(latents)
        kv_input = torch.cat((x, latents), dim=-2)
        k, v = self.to_kv(kv_input).chunk(2, dim=-1)
        q, k, v = [t.reshape(b, m, t.shape[2], h, -1).permute(0, 1, 3, 2, 4) for t in (q, k, v)]
        q = q * self.scale
        sim = torch.einsum('... i d, ... j d -> ... i j', q, k)
        sim = sim - sim.amax(dim=-1, keepdim=True).detach()
        attn = sim.softmax(dim=-1)
        out = torch.einsum('... i j, ... j d -> ... i d', attn, v)
        out = out.permute(0, 1, 3, 2, 4).reshape(b, m, out.shape[3], -1)
        return self.to_out(out)


class PerceiverResampler(nn.Module):
    def __init__(self, *, dim, depth, dim_head=8, heads=2, num_latents=3, num_media_embeds=1, ff_mult=2):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(num_latents, dim))
        self.media_pos_emb = nn.Parameter(torch.randn(num_media_embeds, 1, dim))
        self.layers = nn.ModuleList([])
        for _ in range(depth):
            self.layers.append(nn.ModuleList([
                PerceiverAttention(dim=dim, dim_head=dim_head, heads=heads),
                nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim * ff_mult), nn.GELU(), nn.Linear(dim * ff_mult, dim)),
            ]))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        if x.ndim == 3:
            x = x.unsqueeze(1)
        times = x.shape[1]
        x = x + self.media_pos_emb[:times]
        latents = self.latents.view(1, 1, *self.latents.shape).repeat(x.shape[0], x.shape[1], 1, 1)
        for attn, ff in self.layers:
            latents = attn(x, latents) + latents
            latents = ff(latents) + latents
        return self.norm(latents)


# ---------------- models/gr1.py (act_pred path) ----------------
class GR1(nn.Module):
    def __init__(
            self,
            model_clip,
            model_mae,
            state_dim,
            act_dim,
            hidden_size,
            sequence_length,
            training_target,
            img_feat_dim,
            patch_feat_dim,
            lang_feat_dim,
            resampler_params,
            without_norm_pixel_loss=False,
            use_hand_rgb=True,
            **kwargs
    ):
        super().__init__()
        self.state_dim = state_dim
        self.act_dim = act_dim
        self.sequence_length = sequence_length

        # GPT
        self.hidden_size = hidden_size
        config = transformers.GPT2Config(
            vocab_size=1,
            n_embd=hidden_size,
            **kwargs
        )
        self.transformer = GPT2Model(config)

        # Perciever resampler
        self.n_patch_latents = resampler_params['num_latents']
        self.perceiver_resampler = PerceiverResampler(
            dim=patch_feat_dim,
            depth=resampler_params['depth'],
            dim_head=resampler_params['dim_head'],
            heads=resampler_params['heads'],
            num_latents=self.n_patch_latents,
            num_media_embeds=resampler_params['num_media_embeds'])

        # CLIP for language encoding
        self.model_clip = model_clip
        for _, param in self.model_clip.named_parameters():
            param.requires_grad = False

        # MAE for image encoding
        self.model_mae = model_mae
        for _, param in self.model_mae.named_parameters():
            param.requires_grad = False

        self.img_feat_dim = img_feat_dim
        self.lang_feat_dim = lang_feat_dim
        self.patch_feat_dim = patch_feat_dim
        self.use_hand_rgb = use_hand_rgb

        self.act_pred = False
        self.fwd_pred = False
        self.fwd_pred_hand = False
        if 'act_pred' in training_target:
            self.act_pred = True
        if 'fwd_pred' in training_target:
            self.fwd_pred = True
        if 'fwd_pred_hand' in training_target:
            self.fwd_pred_hand = True
        assert not self.fwd_pred, "the forward-prediction decoder is left out of this port"

        self.without_norm_pixel_loss = without_norm_pixel_loss

        # Embedding functions for states
        self.embed_arm_state = torch.nn.Linear(self.state_dim - 1, hidden_size)
        self.embed_gripper_state = torch.nn.Linear(2, hidden_size)  # one-hot gripper state
        self.embed_state = torch.nn.Linear(2 * hidden_size, hidden_size)

        # Relative timestep embedding
        self.embed_timestep = nn.Embedding(self.sequence_length, hidden_size)

        # Embedding function for languages
        self.embed_lang = torch.nn.Linear(self.lang_feat_dim, hidden_size)

        # Embedding functions for images
        self.embed_hand_img = torch.nn.Linear(self.img_feat_dim, hidden_size)
        self.embed_img = torch.nn.Linear(self.img_feat_dim, hidden_size)
        self.embed_hand_patch = torch.nn.Linear(self.patch_feat_dim, hidden_size)
        self.embed_patch = torch.nn.Linear(self.patch_feat_dim, hidden_size)

        # Layer norm
        self.embed_ln = nn.LayerNorm(hidden_size)

        # Action query token
        self.action_queries = nn.Embedding(1, hidden_size)  # arm + gripper

        # Action prediction
        self.pred_act_mlps = nn.ModuleList([
            nn.Linear(hidden_size, hidden_size // 2),
            nn.Linear(hidden_size // 2, hidden_size // 2)])
        self.pred_arm_act = nn.Linear(hidden_size // 2, self.act_dim - 1)  # arm action
        self.pred_gripper_act = nn.Linear(hidden_size // 2, 1)  # gripper action (binary)

    def forward(self, rgb, hand_rgb, state, language, attention_mask):
        arm_action_preds = None
        gripper_action_preds = None

        batch_size, sequence_length, c, h, w = rgb.shape

        # Embed state
        arm_state = state['arm']
        gripper_state = state['gripper']
        arm_state_embeddings = self.embed_arm_state(arm_state.view(batch_size, sequence_length, self.state_dim - 1))
        gripper_state_embeddings = self.embed_gripper_state(gripper_state)
        state_embeddings = torch.cat((arm_state_embeddings, gripper_state_embeddings), dim=2)
        state_embeddings = self.embed_state(state_embeddings)  # (b, l, h)

        # Embed language
        lang_embeddings = self.model_clip.encode_text(language)
        lang_embeddings = lang_embeddings / (lang_embeddings.norm(dim=1, keepdim=True) + 1e-6)  # normalization
        lang_embeddings = self.embed_lang(lang_embeddings.float())  # (b, h)

        # Get obs and patch feature from MAE
        obs_embeddings, patch_embeddings = self.model_mae(
            rgb.view(batch_size * sequence_length, c, h, w))  # (b * l, img_feat_dim), (b * l, n_patches, patch_feat_dim)
        obs_embeddings = obs_embeddings.view(batch_size, sequence_length, -1)  # (b, l, img_feat_dim)
        if self.use_hand_rgb:
            hand_obs_embeddings, hand_patch_embeddings = self.model_mae(
                hand_rgb.view(batch_size * sequence_length, c, h, w))
            hand_obs_embeddings = hand_obs_embeddings.view(batch_size, sequence_length, -1)  # (b, l, img_feat_dim)

        # Use resampler to process patch embeddings
        patch_embeddings = patch_embeddings.unsqueeze(1)  # (b * l, 1, n_patches, patch_feat_dim)
        patch_embeddings = self.perceiver_resampler(patch_embeddings)  # (b * l, 1, n_patch_latents, patch_feat_dim)
        patch_embeddings = patch_embeddings.squeeze(1)  # (b * l, n_patch_latents, patch_feat_dim)
        patch_embeddings = patch_embeddings.view(batch_size, sequence_length, self.n_patch_latents, self.patch_feat_dim)
        if self.use_hand_rgb:
            hand_patch_embeddings = hand_patch_embeddings.unsqueeze(1)
            hand_patch_embeddings = self.perceiver_resampler(hand_patch_embeddings)
            hand_patch_embeddings = hand_patch_embeddings.squeeze(1)
            hand_patch_embeddings = hand_patch_embeddings.view(batch_size, sequence_length, self.n_patch_latents, self.patch_feat_dim)

        # Embed images and patches
        obs_embeddings = self.embed_img(obs_embeddings.float())  # (b, l, h)
        patch_embeddings = self.embed_patch(patch_embeddings.float())  # (b, l, n_patch_latents, h)
        if self.use_hand_rgb:
            hand_obs_embeddings = self.embed_hand_img(hand_obs_embeddings.float())  # (b, l, h)
            hand_patch_embeddings = self.embed_hand_patch(hand_patch_embeddings.float())  # (b, l, n_patch_latents, h)

        # Add timestep embeddings
        time_embeddings = self.embed_timestep.weight  # (l, h)
        lang_embeddings = lang_embeddings.view(batch_size, 1, -1) + time_embeddings
        state_embeddings = state_embeddings + time_embeddings
        patch_embeddings = patch_embeddings + time_embeddings.view(sequence_length, 1, self.hidden_size)
        obs_embeddings = obs_embeddings + time_embeddings
        if self.use_hand_rgb:
            hand_obs_embeddings = hand_obs_embeddings + time_embeddings
            hand_patch_embeddings = hand_patch_embeddings + time_embeddings.view(sequence_length, 1, self.hidden_size)

        # Format sequence: lang, state, patch, obs, hand_patch, hand_obs, [ACT], [OBS], [OBS_HAND]
        lang_embeddings = lang_embeddings.view(batch_size, sequence_length, 1, self.hidden_size)
        state_embeddings = state_embeddings.view(batch_size, sequence_length, 1, self.hidden_size)
        obs_embeddings = obs_embeddings.view(batch_size, sequence_length, 1, self.hidden_size)
        stacked_inputs = torch.cat(
                (lang_embeddings,
                 state_embeddings,
                 patch_embeddings,
                 obs_embeddings), dim=2)  # (b, l, n_tokens, h)
        if self.use_hand_rgb:
            hand_obs_embeddings = hand_obs_embeddings.view(batch_size, sequence_length, 1, self.hidden_size)
            stacked_inputs = torch.cat(
                (stacked_inputs,
                 hand_patch_embeddings,
                 hand_obs_embeddings), dim=2)  # (b, l, n_tokens, h)
        if self.act_pred:
            action_queries = self.action_queries.weight  # (1, h)
            action_queries = action_queries.view(1, 1, 1, self.hidden_size).repeat(batch_size, sequence_length, 1, 1)  # (b, l, 1, h)
            stacked_inputs = torch.cat((stacked_inputs, action_queries), dim=2)  # (b, l, n_tokens, h)

        # Number of tokens
        n_lang_tokens = 1
        n_state_tokens = 1
        n_patch_tokens = self.n_patch_latents
        n_obs_tokens = 1
        n_hand_patch_tokens = self.n_patch_latents
        n_hand_obs_tokens = 1
        n_tokens = n_lang_tokens + n_state_tokens + n_patch_tokens + n_obs_tokens
        if self.use_hand_rgb:
            n_tokens += n_hand_obs_tokens
            n_tokens += n_hand_patch_tokens
        n_act_pred_tokens = 1
        if self.act_pred:
            act_query_token_start_i = n_tokens
            n_tokens += 1

        # Layer norm
        stacked_inputs = stacked_inputs.reshape(batch_size, n_tokens * sequence_length, self.hidden_size)
        stacked_inputs = self.embed_ln(stacked_inputs)

        # Attention mask
        stacked_attention_mask = attention_mask.view(batch_size, sequence_length, 1)
        if self.use_hand_rgb:
            stacked_attention_mask = stacked_attention_mask.repeat(
                1, 1, n_lang_tokens + n_state_tokens + n_hand_patch_tokens + n_hand_obs_tokens + n_patch_tokens + n_obs_tokens)
        else:
            stacked_attention_mask = stacked_attention_mask.repeat(
                1, 1, n_lang_tokens + n_state_tokens + n_patch_tokens + n_obs_tokens)
        if self.act_pred:
            act_query_attention_mask = torch.zeros(
                (batch_size, sequence_length, n_act_pred_tokens), dtype=torch.long).to(attention_mask.device)
            stacked_attention_mask = torch.cat((stacked_attention_mask, act_query_attention_mask), dim=2)
        stacked_attention_mask = stacked_attention_mask.reshape(batch_size, n_tokens * sequence_length)

        # GPT forward pass
        transformer_outputs = self.transformer(
            inputs_embeds=stacked_inputs,
            attention_mask=stacked_attention_mask,
        )
        x = transformer_outputs['last_hidden_state']
        x = x.reshape(batch_size, sequence_length, n_tokens, self.hidden_size)

        # Action prediction
        if self.act_pred:
            action_embedding = x[:, :, act_query_token_start_i]
            for pred_act_mlp in self.pred_act_mlps:
                action_embedding = pred_act_mlp(action_embedding)
            arm_action_preds = self.pred_arm_act(action_embedding)  # (b, l, act_dim - 1)
            gripper_action_preds = self.pred_gripper_act(action_embedding)  # (b, l, 1)

        prediction = {
            'arm_action_preds': arm_action_preds,
            'gripper_action_preds': gripper_action_preds,
        }
        return prediction


# ---------------- evaluation/calvin_evaluation.py (GR1CalvinEvaluation.step, trimmed) ----------------
class GR1CalvinEvaluation:
    def __init__(self, policy, variant):
        self.policy = policy
        self.seq_len = variant['seq_len']
        self.act_dim = variant['act_dim']
        self.state_dim = variant['state_dim']
        self.device = torch.device('cpu')

    def reset(self):
        self.rgb_list = []
        self.hand_rgb_list = []
        self.state_list = []
        self.rollout_step_counter = 0

    def step(self, obs, tokenized_text):
        rgb = obs['rgb_static']
        self.rgb_list.append(rgb)
        hand_rgb = obs['rgb_gripper']
        self.hand_rgb_list.append(hand_rgb)
        state = obs['robot_obs']
        self.state_list.append(state)

        # Buffer
        buffer_len = len(self.rgb_list)
        if buffer_len > self.seq_len:
            self.rgb_list.pop(0)
            self.hand_rgb_list.pop(0)
            self.state_list.pop(0)
            assert len(self.rgb_list) == self.seq_len
            buffer_len = len(self.rgb_list)

        # Static RGB
        c, h, w = rgb.shape
        rgb_data = torch.zeros((1, self.seq_len, c, h, w))
        rgb_tensor = torch.stack(self.rgb_list, dim=0)  # (l, c, h, w)
        rgb_data[0, :buffer_len] = rgb_tensor

        # Hand RGB
        c, h, w = hand_rgb.shape
        hand_rgb_data = torch.zeros((1, self.seq_len, c, h, w))
        hand_rgb_tensor = torch.stack(self.hand_rgb_list, dim=0)  # (l, c, h, w)
        hand_rgb_data[0, :buffer_len] = hand_rgb_tensor

        # State
        state_tensor = torch.stack(self.state_list, dim=0)  # (l, act_dim)
        gripper_state_data = - torch.ones((1, self.seq_len)).float()
        gripper_state_data[0, :buffer_len] = state_tensor[:, 6]
        gripper_state_data = (gripper_state_data + 1.0) / 2
        gripper_state_data = gripper_state_data.long()
        gripper_state_data = F.one_hot(gripper_state_data, num_classes=2).float()  # (b, l, 2)
        arm_state_data = torch.zeros((1, self.seq_len, self.act_dim - 1)).float()  # (b, l, act_dim - 1)
        arm_state_data[0, :buffer_len] = state_tensor[:, :6]

        # Attention mask
        attention_mask = torch.zeros(1, self.seq_len).long()
        attention_mask[0, :buffer_len] = 1

        state_data = {'arm': arm_state_data, 'gripper': gripper_state_data}
        with torch.no_grad():
            prediction = self.policy(
                rgb=rgb_data,
                hand_rgb=hand_rgb_data,
                state=state_data,
                language=tokenized_text,
                attention_mask=attention_mask
            )

        # Arm action
        arm_action_preds = prediction['arm_action_preds']  # (1, l, act_dim - 1)
        arm_action_preds = arm_action_preds.view(-1, self.act_dim - 1)  # (l, act_dim - 1)
        arm_action_preds = arm_action_preds[attention_mask.flatten() > 0]

        # Gripper action
        gripper_action_preds = prediction['gripper_action_preds']  # (1, l, 1)
        gripper_action_preds = gripper_action_preds.flatten()  # (l, )
        gripper_action_preds = gripper_action_preds[attention_mask.flatten() > 0]

        # Use the last action
        arm_action_pred = arm_action_preds[-1]  # (act_dim - 1, )
        gripper_logit = gripper_action_preds[-1:]  # (1, ) (the logit is kept here for the self-check)

        self.rollout_step_counter += 1
        return arm_action_pred, gripper_logit


# ---------------- reference: valid timesteps only, no padding, no mask, double loop ----------------
def reference_actions(policy, rgb, hand_rgb, arm, gripper_onehot, language):
    """rgb, hand_rgb: (L, c, h, w); arm: (L, 6); gripper_onehot: (L, 2); language: (1, T). Returns (L, 6), (L,)."""
    L = rgb.shape[0]
    H = policy.hidden_size
    n_lat = policy.n_patch_latents
    te = policy.embed_timestep.weight[:L]
    st = policy.embed_state(torch.cat((policy.embed_arm_state(arm), policy.embed_gripper_state(gripper_onehot)), dim=1)) + te
    lang = policy.model_clip.encode_text(language)
    lang = policy.embed_lang(lang / (lang.norm(dim=1, keepdim=True) + 1e-6)).view(1, H) + te
    obs, patch = policy.model_mae(rgb)
    hobs, hpatch = policy.model_mae(hand_rgb)
    patch = policy.embed_patch(policy.perceiver_resampler(patch.unsqueeze(1)).squeeze(1)) + te.view(L, 1, H)
    hpatch = policy.embed_hand_patch(policy.perceiver_resampler(hpatch.unsqueeze(1)).squeeze(1)) + te.view(L, 1, H)
    obs = policy.embed_img(obs) + te
    hobs = policy.embed_hand_img(hobs) + te
    act = policy.action_queries.weight.expand(L, H)
    rows, is_act = [], []
    for t in range(L):
        toks = [lang[t:t + 1], st[t:t + 1], patch[t], obs[t:t + 1], hpatch[t], hobs[t:t + 1], act[t:t + 1]]
        rows.append(torch.cat(toks, dim=0))
        is_act += [False] * (3 + 2 * n_lat + 1) + [True]
    x = policy.embed_ln(torch.cat(rows, dim=0))  # (L * n_tokens, H)
    N = x.shape[0]
    for blk in policy.transformer.h:
        a = blk.attn
        hd = H // a.n_head
        q, k, v = a.c_attn(blk.ln_1(x)).split(H, dim=1)
        out = torch.zeros(N, H)
        for i in range(N):
            keys = [j for j in range(i + 1) if not is_act[j]]  # earlier tokens, never an [ACT] query
            for hh in range(a.n_head):
                sl = slice(hh * hd, (hh + 1) * hd)
                s = torch.stack([q[i, sl] @ k[j, sl] for j in keys]) / hd ** 0.5
                p = torch.softmax(s, dim=0)
                out[i, sl] = sum(p[n] * v[j, sl] for n, j in enumerate(keys))
        x = x + a.c_proj(out)
        x = x + blk.mlp(blk.ln_2(x))
    x = policy.transformer.ln_f(x)
    n_tokens = len(is_act) // L
    e = x.view(L, n_tokens, H)[:, n_tokens - 1]
    for m in policy.pred_act_mlps:
        e = m(e)
    return policy.pred_arm_act(e), policy.pred_gripper_act(e).flatten()


def main():
    variant = dict(seq_len=4, act_dim=7, state_dim=7, embed_dim=32, n_layer=2, n_head=4, img_feat_dim=20,
                   patch_feat_dim=12, lang_feat_dim=16, resampler_depth=1, resampler_dim_head=8, resampler_heads=2,
                   resampler_num_latents=3, resampler_num_media_embeds=1, activation_function='relu', dropout=0.1)
    resampler_params = dict(depth=variant['resampler_depth'], dim_head=variant['resampler_dim_head'],
                            heads=variant['resampler_heads'], num_latents=variant['resampler_num_latents'],
                            num_media_embeds=variant['resampler_num_media_embeds'])
    policy = GR1(
        model_clip=TinyClip(embed_dim=variant['lang_feat_dim']),
        model_mae=TinyMAE(img_feat_dim=variant['img_feat_dim'], patch_feat_dim=variant['patch_feat_dim']),
        state_dim=variant['state_dim'],
        act_dim=variant['act_dim'],
        hidden_size=variant['embed_dim'],
        sequence_length=variant['seq_len'],
        training_target=['act_pred'],
        img_feat_dim=variant['img_feat_dim'],
        lang_feat_dim=variant['lang_feat_dim'],
        patch_feat_dim=variant['patch_feat_dim'],
        resampler_params=resampler_params,
        use_hand_rgb=True,
        n_layer=variant['n_layer'],
        n_head=variant['n_head'],
        n_inner=4 * variant['embed_dim'],
        activation_function=variant['activation_function'],
        n_positions=1024,
        resid_pdrop=variant['dropout'],
        attn_pdrop=variant['dropout'],
        embd_pdrop=variant['dropout'])
    with torch.no_grad():  # larger weights than GPT2's 0.02 init, so that attention is far from uniform
        for name, p in policy.transformer.named_parameters():
            if name.endswith('c_attn.weight'):
                p.normal_(0.0, 0.3)
    policy.eval()

    seq_len, c, hw = variant['seq_len'], 3, 8

    def rand_obs():
        g = torch.tensor([1.0 if torch.rand(()) > 0.5 else -1.0])
        return {'rgb_static': torch.randn(c, hw, hw), 'rgb_gripper': torch.randn(c, hw, hw),
                'robot_obs': torch.cat((torch.randn(6), g))}

    text = torch.tensor([[49, 7, 12, 33, 48, 0, 0, 0]])  # CLIP-style: start 49 ... EOT 48, zero padded
    n_checked = 0

    # (1) a right-padded batch of two windows (valid lengths 2 and 4), padded frames filled with noise
    lengths = [2, 4]
    B = len(lengths)
    rgb = torch.randn(B, seq_len, c, hw, hw)
    hand = torch.randn(B, seq_len, c, hw, hw)
    arm = torch.randn(B, seq_len, 6)
    grip = F.one_hot(torch.randint(0, 2, (B, seq_len)), num_classes=2).float()
    attention_mask = torch.zeros(B, seq_len).long()
    for b, n in enumerate(lengths):
        attention_mask[b, :n] = 1
    language = text.repeat(B, 1)
    with torch.no_grad():
        pred = policy(rgb=rgb, hand_rgb=hand, state={'arm': arm, 'gripper': grip}, language=language,
                      attention_mask=attention_mask)
        noisy = policy(rgb=torch.where(attention_mask.bool()[:, :, None, None, None], rgb, 5 * torch.randn_like(rgb)),
                       hand_rgb=torch.where(attention_mask.bool()[:, :, None, None, None], hand, 5 * torch.randn_like(hand)),
                       state={'arm': torch.where(attention_mask.bool()[:, :, None], arm, 5 * torch.randn_like(arm)),
                              'gripper': grip.flip(-1) * (1 - attention_mask[:, :, None]) + grip * attention_mask[:, :, None]},
                       language=language, attention_mask=attention_mask)
        for b, n in enumerate(lengths):
            ref_arm, ref_grip = reference_actions(policy, rgb[b, :n], hand[b, :n], arm[b, :n], grip[b, :n], text)
            assert torch.allclose(pred['arm_action_preds'][b, :n], ref_arm, atol=1e-5), (b, n)
            assert torch.allclose(pred['gripper_action_preds'][b, :n, 0], ref_grip, atol=1e-5), (b, n)
            assert torch.allclose(noisy['arm_action_preds'][b, :n], pred['arm_action_preds'][b, :n], atol=1e-5)
            assert torch.allclose(noisy['gripper_action_preds'][b, :n], pred['gripper_action_preds'][b, :n], atol=1e-5)
            n_checked += n

    # (2) the CALVIN step loop: the buffer fills (right padding) and then slides
    agent = GR1CalvinEvaluation(policy, variant)
    agent.reset()
    history = []
    for t in range(seq_len + 3):
        obs = rand_obs()
        history.append(obs)
        arm_pred, grip_logit = agent.step(obs, text)
        window = history[-seq_len:]
        w_rgb = torch.stack([o['rgb_static'] for o in window])
        w_hand = torch.stack([o['rgb_gripper'] for o in window])
        w_state = torch.stack([o['robot_obs'] for o in window])
        w_grip = F.one_hot(((w_state[:, 6] + 1.0) / 2).long(), num_classes=2).float()
        with torch.no_grad():
            ref_arm, ref_grip = reference_actions(policy, w_rgb, w_hand, w_state[:, :6], w_grip, text)
        assert torch.allclose(arm_pred, ref_arm[-1], atol=1e-5), t
        assert torch.allclose(grip_logit, ref_grip[-1:], atol=1e-5), t
        n_checked += 1

    print(f"GR-1 right-padded windows: {n_checked} actions match the unpadded double-loop reference")


if __name__ == "__main__":
    main()
