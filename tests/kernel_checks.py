"""What every --use-experimental-kernels engine test checks, on one model: the engine with the
flag gives `want`, compiling nothing while serving; artifacts exported from it serve the same
with 0 compiles, with the flag and without (the default follows the artifacts); a run with
--no-use-experimental-kernels is refused naming the flag. Returns the engine."""
import pytest

from maxjax.errors import UserError


def kernels_engine_round_trip(model, engine: dict, prompts, sampling, want, art_dir):
    from maxjax.aot.export import export_engine
    from maxjax.llm import LLM
    llm = LLM(model, use_experimental_kernels=True, **engine)
    assert [o.token_ids for o in llm.generate(prompts, sampling)] == want
    assert llm.core.step_compiles == 0
    export_engine(str(art_dir), llm.core)
    again = LLM(model, use_experimental_kernels=True, precompiled_artifacts=[str(art_dir)],
                **engine)
    assert [o.token_ids for o in again.generate(prompts, sampling)] == want
    assert again.core.step_compiles == 0
    default = LLM(model, precompiled_artifacts=[str(art_dir)], **engine)
    assert [o.token_ids for o in default.generate(prompts, sampling)] == want
    assert default.core.step_compiles == 0 and default.engine_config.use_experimental_kernels
    with pytest.raises(UserError, match="--use-experimental-kernels"):
        LLM(model, precompiled_artifacts=[str(art_dir)], use_experimental_kernels=False,
            **engine)
    return llm
