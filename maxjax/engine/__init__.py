"""The engine: block manager, scheduler, model runner, sampling and the loop that drives them."""
