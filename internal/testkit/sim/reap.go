package sim

import (
	"context"

	"github.com/ashlock/ashlock/sqllock"
)

// MutantReapForgetsFloor deletes an expired key without raising the
// floor, so its next grant starts again at token 1 (C-TOKEN must see the
// regression). Only with Config.Reap.
const MutantReapForgetsFloor = "reap-forgets-floor"

// reap deletes every key whose lease has ended (memory's Reap, no
// retention), key (just expired) among them; with MutantReapForgetsFloor
// it forgets key instead, as a delete that forgets the floor would.
func (w *world) reap(key string) {
	if w.cfg.Mutant == MutantReapForgetsFloor {
		w.mem.SetToken(key, 0) // as if the row were deleted and the floor not raised
		return
	}
	if _, err := w.mem.Reap(context.Background(), 0, sqllock.MaxReapLimit); err != nil {
		panic(err) // memory's Reap fails only on bad input
	}
}
