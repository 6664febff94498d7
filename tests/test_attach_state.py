"""routing/attach.py keeps no mask past its use: a layer's mask is cleared once o_proj / down_proj read it, so a traced
graph does not return every layer's masks as outputs (Dynamo replays attribute writes after the graph, which makes
each stored mask an output Inductor must write, and keeps it from fusing the threshold into the mask's consumer)."""
import torch

import wide_compile as wc
from wide_compile.models.tiny import tiny_model
from wide_compile.routing.attach import _ATTR


def _outputs(model, ids) -> int:
    seen = []

    def backend(gm, example_inputs):
        (out,) = [n for n in gm.graph.nodes if n.op == "output"]
        seen.append(len(torch.utils._pytree.tree_leaves(out.args)))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend, fullgraph=True)(ids)
    torch._dynamo.reset()
    return seen[0]


def test_masks_are_cleared_after_use_and_are_no_graph_outputs():
    model = tiny_model("llama").eval()
    ids = torch.randint(0, 100, (1, 9))
    dense = _outputs(model, ids)
    routers = wc.Routers.init(model, wc.WideConfig(ffn_group_size=16, router_init="random"), seed=1)
    wc.attach(model, routers)
    with torch.no_grad():
        model(ids)
    states = getattr(model, _ATTR).states
    assert len(states) == model.config.num_hidden_layers
    assert all(st.attn is None and st.ffn is None for st in states)
    assert _outputs(model, ids) == dense  # the routed graph returns what the dense one does, no masks
