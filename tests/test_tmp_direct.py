import pytest, torch
@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_off(make_trainer, fixes_off, kind):
    tr = make_trainer(kind)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        tr.train()
@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_on(make_trainer, kind):
    tr = make_trainer(kind)
    tr.train()
    print(tr.state.global_step)
