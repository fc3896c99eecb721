package cli

import "context"

func cmdBench(ctx context.Context, e *env, args []string) error {
	return fail(ExitFailure, "not implemented yet")
}
