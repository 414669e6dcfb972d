"""`maxjax benchmark`: the load-test client, its statistics and report."""
