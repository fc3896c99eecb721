package main

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"slices"
	"strings"
	"time"
)

// Report is everything one run measured; latest.json is this, encoded.
type Report struct {
	Started     time.Time    `json:"started"`
	Seconds     float64      `json:"seconds"`
	Quick       bool         `json:"quick"`
	Flags       []string     `json:"flags,omitempty"` // what the run measured differently from the default (-out aside)
	Rounds      int          `json:"rounds"`
	CellSeconds float64      `json:"cell_seconds"`
	Keys        int          `json:"keys"`
	Env         Env          `json:"env"`
	Cells       []Cell       `json:"cells"`
	Ratios      []Ratio      `json:"ratios"`
	Handoff     []Latency    `json:"handoff,omitempty"`
	Takeover    []Latency    `json:"takeover,omitempty"`
	Async       *AsyncResult `json:"async_release,omitempty"`
	Renewal     []Renewal    `json:"renewal,omitempty"`
	BatchRenew  []BatchRenew `json:"batch_renew,omitempty"`
	// SQLiteBusyRetries is sqlite.Backend.Stats().BusyRetries after the
	// SQLite section, per backend.
	SQLiteBusyRetries map[string]uint64 `json:"sqlite_busy_retries,omitempty"`
	Etcd              *EtcdResult       `json:"etcd,omitempty"`
	MariaDBVersion    string            `json:"mariadb_version,omitempty"`
	Redis             *RedisResult      `json:"redis,omitempty"`

	ratioIndex map[string]float64
}

var (
	pgRatios = [][2]string{
		{"raw-async", "raw"}, {"backend", "raw"}, {"backend-durable", "raw"}, {"backend-nonotify", "raw"}, {"client", "raw"}, {"pglock", "raw"}, {"advisory", "raw"}, {"floor", "raw"},
		{"backend", "raw-async"}, {"client", "raw-async"}, {"backend-nonotify", "raw-async"}, {"client", "backend"},
		{"backend", "pglock"}, {"client", "pglock"}, {"backend-durable", "pglock"}, {"backend", "advisory"}, {"client", "advisory"},
		{"backend", "backend-durable"}, {"backend", "backend-nonotify"},
		{"backend-sqldb-pgx", "backend"}, {"backend-sqldb-pq", "backend"}, {"backend-sqldb-pgx", "pglock"}, {"backend-sqldb-pq", "pglock"},
		{"backend-sqldb-pq-unnamed", "backend"}, {"backend-sqldb-pq-unnamed", "pglock"}, {"backend-sqldb-pq", "backend-sqldb-pq-unnamed"},
	}
	sqliteRatios      = [][2]string{{"ashlock-FULL", "raw-FULL"}, {"ashlock-NORMAL", "raw-NORMAL"}, {"ashlock-NORMAL", "flock"}, {"ashlock-FULL", "flock"}}
	memoryRatios      = [][2]string{{"ashlock-memory", "mutex-map"}, {"ashlock-memory-client", "mutex-map"}}
	groupCommitRatios = [][2]string{{"raw-coalesced", "raw"}, {"backend", "raw"}, {"backend-durable", "raw"},
		{"backend-nogc", "raw"}, {"backend-durable-nogc", "raw"}, {"backend", "backend-nogc"}, {"backend-durable", "backend-durable-nogc"}}
	hotkeyRatios = [][2]string{{"backend", "raw-update"}, {"backend", "raw-upsert"}, {"backend", "pglock"}}
)

func ratioKey(section, a, b string, g int) string {
	return fmt.Sprintf("%s|%s|%s|%d", section, a, b, g)
}

func (r *Report) addMatrix(m *matrix, pairs [][2]string) {
	r.Cells = append(r.Cells, m.cells()...)
	for _, g := range m.conc {
		for _, p := range pairs {
			r.addRatio(Ratio{Section: m.section, A: p[0], B: p[1], Goroutines: g, AOverB: m.ratio(p[0], p[1], g)})
		}
	}
}

func (r *Report) addRatio(x Ratio) {
	if r.ratioIndex == nil {
		r.ratioIndex = map[string]float64{}
	}
	r.Ratios = append(r.Ratios, x)
	r.ratioIndex[ratioKey(x.Section, x.A, x.B, x.Goroutines)] = x.AOverB
}

func (r *Report) ratio(section, a, b string, g int) float64 {
	v, ok := r.ratioIndex[ratioKey(section, a, b, g)]
	if !ok {
		return math.NaN()
	}
	return v
}

func (r *Report) rate(section, contender string, g int) float64 {
	c, ok := r.cell(section, contender, g)
	if !ok {
		return math.NaN()
	}
	return c.OpsPerSec
}

func (r *Report) cell(section, contender string, g int) (Cell, bool) {
	for _, c := range r.Cells {
		if c.Section == section && c.Contender == contender && c.Goroutines == g {
			return c, true
		}
	}
	return Cell{}, false
}

func (r *Report) concs(section string) []int {
	var gs []int
	for _, c := range r.Cells {
		if c.Section == section && !slices.Contains(gs, c.Goroutines) {
			gs = append(gs, c.Goroutines)
		}
	}
	slices.Sort(gs)
	return gs
}

func readReport(path string) (*Report, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	r := new(Report)
	if err := json.Unmarshal(b, r); err != nil {
		return nil, err
	}
	for _, x := range r.Ratios {
		if r.ratioIndex == nil {
			r.ratioIndex = map[string]float64{}
		}
		r.ratioIndex[ratioKey(x.Section, x.A, x.B, x.Goroutines)] = x.AOverB
	}
	return r, nil
}

func (r *Report) writeJSON(path string) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}

var names = map[string]string{
	"etcd|mutex":   "etcd `concurrency.Mutex` TryLock + Unlock",
	"etcd|backend": "ashlock etcd Backend",
	"etcd|client":  "ashlock Client + Guard on etcd",

	"mariadb|raw":                  "raw two statements on MariaDB",
	"mariadb|backend":              "ashlock MariaDB Backend",
	"mariadb|raw-lockwait":         "raw two statements under the backend's lock-wait prefix",
	"mariadb|backend-session":      "ashlock MariaDB Backend, lock wait set by the DSN",
	"mariadb|backend-session-nogc": "ashlock MariaDB Backend, lock wait set by the DSN, DisableGroupCommit",

	"pg|raw":                      "raw two statements via pgx, durable (the limit)",
	"pg|raw-async":                "raw two statements, release committed asynchronously",
	"pg|backend":                  "ashlock Backend, defaults (asynchronous release)",
	"pg|backend-durable":          "ashlock Backend, DurableRelease",
	"pg|backend-nonotify":         "ashlock Backend, DisableNotify",
	"pg|backend-sqldb-pgx":        "ashlock Backend, NewDB (pgx stdlib)",
	"pg|backend-sqldb-pq":         "ashlock Backend, NewDB (lib/pq, statements prepared per connection)",
	"pg|backend-sqldb-pq-unnamed": "ashlock Backend, NewDB (lib/pq, UnnamedStatements: as behind a pooler)",
	"pg|client":                   "ashlock Client + Guard, defaults",
	"pg|pglock":                   "cirello.io/pglock v1.16.1",
	"pg|advisory":                 "pg_try_advisory_lock + unlock (no durability, no fencing)",
	"pg|floor":                    "two `SELECT 1` (round-trip floor, writes nothing)",

	"hotkey|backend":    "ashlock TryAcquire",
	"hotkey|raw-upsert": "raw INSERT … ON CONFLICT DO UPDATE … WHERE",
	"hotkey|raw-update": "raw conditional UPDATE",
	"hotkey|pglock":     "pglock, FailIfLocked",
	"hotkey|advisory":   "pg_try_advisory_lock",

	"async|raw":               "raw pair, durable release",
	"async|raw-async-stmt":    "raw pair, release with set_config in the statement",
	"async|raw-async-session": "raw pair, release on a synchronous_commit=off pool",

	"sqlite|ashlock-FULL":   "ashlock SQLite, synchronous=FULL",
	"sqlite|raw-FULL":       "raw two statements, FULL",
	"sqlite|ashlock-NORMAL": "ashlock SQLite, synchronous=NORMAL",
	"sqlite|raw-NORMAL":     "raw two statements, NORMAL",
	"sqlite|flock":          "flock(2) lock + unlock (256 files)",

	"groupcommit|raw":                  "raw, durable pair (the limit)",
	"groupcommit|raw-coalesced":        "raw, coalesced (the best case)",
	"groupcommit|backend":              "ashlock Backend, group commit (default)",
	"groupcommit|backend-durable":      "ashlock Backend, group commit, DurableRelease",
	"groupcommit|backend-nogc":         "ashlock Backend, DisableGroupCommit",
	"groupcommit|backend-durable-nogc": "ashlock Backend, DisableGroupCommit, DurableRelease",

	"memory|ashlock-memory":        "ashlock memory Backend",
	"memory|ashlock-memory-client": "ashlock Client + Guard on memory",
	"memory|mutex-map":             "mutex-guarded map",
}

func name(section, c string) string {
	if n, ok := names[section+"|"+c]; ok {
		return n
	}
	return c
}

// num formats a rate: thousands separators, no decimals above 100.
func num(f float64) string {
	switch {
	case math.IsNaN(f):
		return "–"
	case f >= 100:
		s := fmt.Sprintf("%.0f", f)
		var b strings.Builder
		for i, c := range s {
			if i > 0 && (len(s)-i)%3 == 0 {
				b.WriteByte(',')
			}
			b.WriteRune(c)
		}
		return b.String()
	case f >= 10:
		return fmt.Sprintf("%.1f", f)
	default:
		return fmt.Sprintf("%.2f", f)
	}
}

func ratioStr(f float64) string {
	if math.IsNaN(f) || math.IsInf(f, 0) {
		return "–"
	}
	if f >= 10 {
		return fmt.Sprintf("%.0f×", f)
	}
	return fmt.Sprintf("%.2f×", f)
}

func msStr(usec float64) string {
	if usec == 0 {
		return "–"
	}
	return fmt.Sprintf("%.2f", usec/1000)
}

func ptr(p *float64, format string) string {
	if p == nil {
		return "–"
	}
	return fmt.Sprintf(format, *p)
}

func (r *Report) markdown() string {
	var b strings.Builder
	w := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }
	mode := "default run"
	switch {
	case len(r.Flags) > 0 && !(r.Quick && len(r.Flags) == 1 && r.Flags[0] == "-quick=true"):
		mode = "not the default run: its figures are not the committed results'"
	case r.Quick:
		mode = "`-quick` run"
	}
	command := strings.Join(append([]string{"go run ."}, r.Flags...), " ")
	w("# ashlock benchmarks\n\n")
	w("`cd bench && %s` (%s): %d interleaved round(s), %.1f s per throughput cell, random keys from %s; took %s; started %s.\n\n",
		command, mode, r.Rounds, r.CellSeconds, num(float64(r.Keys)), (time.Duration(r.Seconds) * time.Second).Round(time.Second), r.Started.Format("2006-01-02 15:04 UTC"))
	e := r.Env
	w("- **Machine**: %d CPUs (%s), %.1f GiB RAM, Linux %s; temp and data directories on %s, where one 8 KiB write + fdatasync at a time runs %s/s.\n",
		e.CPUs, e.CPUModel, e.MemoryGiB, e.Kernel, e.TempFS, num(e.Fdatasyncs))
	w("- **Versions**: Go %s; PostgreSQL %s; SQLite %s (modernc.org/sqlite %s); pgx %s; cirello.io/pglock %s (on lib/pq %s, the driver its `New` requires).\n",
		strings.TrimPrefix(e.Go, "go"), orDash(e.PGVersion), e.SQLiteVersion, e.Modules["modernc.org/sqlite"], e.Modules["github.com/jackc/pgx/v5"], e.Modules["cirello.io/pglock"], e.Modules["github.com/lib/pq"])
	if len(e.PGSettings) > 0 {
		var kv []string
		for _, k := range pgSettingNames {
			if v, ok := e.PGSettings[k]; ok {
				kv = append(kv, k+"="+v)
			}
		}
		w("- **PostgreSQL settings** (server defaults; the throwaway server only sets listen address, port and max_connections): %s.\n", strings.Join(kv, ", "))
	}
	w("- **SQLite**: WAL journal, busy_timeout 10 ms, one connection per database (as `sqlite.Open`), synchronous as stated.\n")
	w("\nRates are medians over rounds; a ratio is the median of the per-round ratios (every round runs all contenders back to back, in rotated order, so drift on this shared machine hits them alike); p50/p99 pool the latencies of all rounds.\n")

	if gs := r.concs("pg"); len(gs) > 0 {
		w("\n## PostgreSQL: acquire + release pairs/s\n\nEach pair is a TryAcquire of a random key (of %s, all present and released) and its Release; 30 s TTL; one pgx pool (max %d connections) for ashlock, the raw statements and the advisory locks; pglock on its own `database/sql` pool.\n\n", num(float64(r.Keys)), slices.Max(gs))
		w("| contender | %s |\n|---|%s\n", cols(gs, "", false), strings.Repeat("--:|", len(gs)))
		order := []string{"raw", "raw-async", "backend", "backend-durable", "backend-nonotify", "backend-sqldb-pgx", "backend-sqldb-pq", "backend-sqldb-pq-unnamed", "client", "pglock", "advisory", "floor"}
		for _, c := range order {
			w("| %s |", name("pg", c))
			for _, g := range gs {
				cell, ok := r.cell("pg", c, g)
				if !ok {
					w(" – |")
					continue
				}
				if c == "raw" {
					w(" **%s** |", num(cell.OpsPerSec))
				} else {
					w(" %s (%s) |", num(cell.OpsPerSec), ratioStr(r.ratio("pg", c, "raw", g)))
				}
			}
			w("\n")
		}
		w("\nIn parentheses: the ratio to the raw two statements with a durable release (the first row), same rounds. ashlock's Release commits asynchronously by default (see \"Asynchronous release\" below), so like for like the default compares with the second row and `DurableRelease` with the first: see the ratios below.\n\n")
		w("Latency of one pair, p50 / p99 in ms:\n\n| contender | %s |\n|---|%s\n", cols(gs, "", true), strings.Repeat("--:|", len(gs)))
		for _, c := range order {
			w("| %s |", name("pg", c))
			for _, g := range gs {
				cell, _ := r.cell("pg", c, g)
				w(" %s / %s |", msStr(cell.P50us), msStr(cell.P99us))
			}
			w("\n")
		}
		w("\nRatios and targets (docs/benchmark-targets.md):\n\n| comparison | %s | target |\n|---|%s--|\n", cols(gs, "", true), strings.Repeat("--:|", len(gs)))
		for _, p := range []struct{ a, b, target string }{
			{"backend", "raw-async", "≥ 0.9× at every concurrency (like for like: both releases asynchronous)"},
			{"backend-durable", "raw", "≥ 0.9× at every concurrency (like for like: both releases durable)"},
			{"client", "raw-async", ""}, {"client", "backend", "≥ 0.95× at every concurrency"},
			{"backend", "pglock", "≥ 2× at every concurrency"}, {"client", "pglock", "≥ 2× at every concurrency"}, {"backend-durable", "pglock", ""},
			{"backend", "raw", "cross comparison: asynchronous release against durable"}, {"client", "raw", "cross comparison"},
			{"raw-async", "raw", "what an asynchronous release buys the raw pair"}, {"backend", "backend-durable", "what it buys ashlock"},
			{"backend", "backend-nonotify", "what notifications cost (none are sent without a waiter)"},
			{"backend-sqldb-pgx", "backend", "≥ 0.9× at every concurrency (NewDB on pgx's stdlib driver against New)"},
			{"backend-sqldb-pq", "backend", "≥ 0.9× at every concurrency (NewDB on lib/pq, binary_parameters=yes)"},
			{"backend-sqldb-pgx", "pglock", "≥ 1.5× at every concurrency"}, {"backend-sqldb-pq", "pglock", "≥ 1.5× at every concurrency (both on lib/pq)"},
			{"backend-sqldb-pq-unnamed", "backend", "NewDB on lib/pq behind a pooler (unnamed statements, parsed and planned on every call)"},
			{"backend-sqldb-pq-unnamed", "pglock", ""},
			{"backend-sqldb-pq", "backend-sqldb-pq-unnamed", "what preparing lib/pq's statements buys"},
			{"backend", "advisory", ""}, {"client", "advisory", ""},
		} {
			w("| %s / %s |", shortName(p.a), shortName(p.b))
			for _, g := range gs {
				w(" %s |", ratioStr(r.ratio("pg", p.a, p.b, g)))
			}
			w(" %s |\n", p.target)
		}
		w("\nCost per pair (medians over rounds; statements counted by a pgx tracer, WAL from `pg_current_wal_insert_lsn()`, transaction ids from `pg_current_snapshot()`):\n\n| contender | goroutines | statements | WAL bytes | xids |\n|---|--:|--:|--:|--:|\n")
		for _, c := range order {
			for _, g := range []int{gs[0], gs[len(gs)-1]} {
				cell, _ := r.cell("pg", c, g)
				st := ptr(cell.StatementsPerOp, "%.2f")
				if c == "pglock" {
					st = "3–4 by its code (not traced: lib/pq)"
				}
				w("| %s | %d | %s | %s | %s |\n", name("pg", c), g, st, ptr(cell.WALBytesPerOp, "%.0f"), ptr(cell.XIDsPerOp, "%.2f"))
			}
		}
		w("\npglock per pair: `nextval` + the upsert, then its heartbeat goroutine starts at once with another `nextval` (its `UPDATE` rarely runs before the release cancels it: see the xids), then a `DELETE`; a cancelled query also costs lib/pq a cancel request on a new connection.\n")
		w("\nChart: [`%s`](%s) (pairs/s against goroutines, log scales).\n", chartFile, chartFile)
	}

	if gs := r.concs("hotkey"); len(gs) > 0 {
		w("\n## Hot key: TryAcquire on a key someone else holds\n\nEvery attempt fails. What a waiter polling a hot key costs the database:\n\n")
		w("| attempt | %s | p50 at %d (ms) | WAL bytes / attempt | xids / attempt |\n|---|%s--:|--:|--:|\n", cols(gs, ", attempts/s", false), gs[0], strings.Repeat("--:|", len(gs)))
		for _, c := range []string{"backend", "raw-update", "raw-upsert", "pglock", "advisory"} {
			w("| %s |", name("hotkey", c))
			var first Cell
			for i, g := range gs {
				cell, _ := r.cell("hotkey", c, g)
				if i == 0 {
					first = cell
				}
				w(" %s |", num(cell.OpsPerSec))
			}
			w(" %s | %s | %s |\n", msStr(first.P50us), ptr(first.WALBytesPerOp, "%.1f"), ptr(first.XIDsPerOp, "%.3f"))
		}
		var rs []string
		for _, g := range gs {
			rs = append(rs, fmt.Sprintf("at %d: %s the conditional UPDATE, %s the upsert, %s pglock", g,
				ratioStr(r.ratio("hotkey", "backend", "raw-update", g)), ratioStr(r.ratio("hotkey", "backend", "raw-upsert", g)), ratioStr(r.ratio("hotkey", "backend", "pglock", g))))
		}
		w("\nashlock's failed attempts per second against the others, same rounds: %s.\n", strings.Join(rs, "; "))
		w("\nTarget: a contended TryAcquire writes no WAL and assigns no transaction id (WAL and xids are measured at %d goroutine%s; background activity such as autovacuum can add a little).\n", gs[0], plural(gs[0]))
	}

	if len(r.Handoff) > 0 {
		w("\n## Handoff: release → a waiting Acquire holds\n\nThe holder releases after holding 20–120 ms while the waiter waits in `Acquire` (holder and waiter each have their own pool and client); the time runs from just before the holder's Release to the waiter's Acquire returning.\n\n| waiter | n | p50 ms | p90 ms | p99 ms | max ms | note |\n|---|--:|--:|--:|--:|--:|---|\n")
		for _, l := range r.Handoff {
			w("| %s | %d | %.2f | %.2f | %.2f | %.2f | %s |\n", l.Name, l.N, l.P50ms, l.P90ms, l.P99ms, l.MaxMs, l.Note)
		}
		w("\nTarget (PostgreSQL, with notifications): p50 ≤ 2 ms, p99 ≤ 20 ms (docs/benchmark-targets.md). With %d samples, p99 is close to the maximum.\n", r.Handoff[0].N)
		var ash, raw *Latency
		for i := range r.Handoff {
			switch r.Handoff[i].Name {
			case notifyHandoffName:
				ash = &r.Handoff[i]
			case rawHandoffName:
				raw = &r.Handoff[i]
			}
		}
		if ash != nil && raw != nil && raw.P50ms > 0 {
			w("\nThe floor: a hand-written lock on the raw statements (%s: the raw release with a `pg_notify` in the same statement, committed asynchronously as ashlock's; the waiter, refused by the raw upsert, LISTENs on a connection of its own and sends the upsert again when notified; interleaved with ashlock's samples) hands off in p50 %.2f ms, p99 %.2f ms here; ashlock's default handoff is %.2f× that p50. Each handoff is two statements, a durable commit, a notification and the wake-ups of idle processes between them; on this machine these alone take what the raw row shows.\n",
				raw.Name, raw.P50ms, raw.P99ms, ash.P50ms/raw.P50ms)
		}
	}
	if len(r.Takeover) > 0 {
		w("\n## Takeover after a crashed holder\n\nA holder takes the key with a %v lease and never renews or releases it; a waiter calls `Acquire` 30 ms later. Sample: the new lease's grant time minus the old lease's deadline, both by the backend's clock (SQLite's in whole milliseconds).\n\n| backend | n | p50 ms | p90 ms | max ms |\n|---|--:|--:|--:|--:|\n", takeoverTTL)
		for _, l := range r.Takeover {
			w("| %s | %d | %.2f | %.2f | %.2f |\n", l.Name, l.N, l.P50ms, l.P90ms, l.MaxMs)
		}
		w("\nTarget: ≤ database deadline + one poll interval + one round trip. The waiter sleeps at most the holder's remaining lease (read in its failed attempt), so it retries right at the deadline.\n")
	}
	if a := r.Async; a != nil {
		gs := concsOf(a.Cells)
		w("\n## Asynchronous release\n\nashlock's Release commits asynchronously by default: its statement sets `synchronous_commit` off for its own transaction with `set_config('synchronous_commit', 'off', true)` in the RETURNING of the row it releases (a release that releases nothing commits nothing); `postgres.Options{DurableRelease: true}` turns that off. One statement, one round trip either way; acquires and renewals stay durable. The PostgreSQL table above compares the two on ashlock. Here, the two ways of doing it on the raw pair:\n\n")
		w("| pair | %s |\n|---|%s\n", cols(gs, "", true), strings.Repeat("--:|", len(gs)))
		idx := map[string]float64{}
		for _, x := range a.Ratios {
			idx[ratioKey("", x.A, x.B, x.Goroutines)] = x.AOverB
		}
		for _, c := range []string{"raw", "raw-async-stmt", "raw-async-session"} {
			w("| %s |", name("async", c))
			for _, g := range gs {
				cell := findCell(a.Cells, c, g)
				if c == "raw" {
					w(" %s |", num(cell.OpsPerSec))
				} else {
					w(" %s (%s) |", num(cell.OpsPerSec), ratioStr(idx[ratioKey("", c, "raw", g)]))
				}
			}
			w("\n")
		}
		w("\nIn parentheses: the ratio to the durable release in the same rounds.\n\nDoes it take effect? One connection, pairs one after another; WAL syncs from `pg_stat_wal.wal_sync` (all processes, the WAL writer's background flushes included); \"unflushed\": right after the release's reply, another connection found `pg_current_wal_flush_lsn()` behind `pg_current_wal_insert_lsn()`, i.e. the release's commit record was not yet on disk:\n\n| release | pairs | WAL syncs / pair | unflushed after release | release p50 µs | release p99 µs | `synchronous_commit` on that connection afterwards |\n|---|--:|--:|--:|--:|--:|---|\n")
		for _, c := range a.Checks {
			w("| %s | %d | %.2f | %.0f%% | %.0f | %.0f | %s |\n", c.Variant, c.Pairs, c.WALSyncsPerPair, c.UnflushedPct, c.ReleaseP50us, c.ReleaseP99us, c.SessionSetting)
		}
		for _, n := range a.Notes {
			w("\n%s\n", n)
		}
	}
	if len(r.Renewal) > 0 {
		w("\n## Renewal load: one process holding many leases\n\nOne Client; its Guards renew every TTL/3, those due together in one statement (batch renewal). Measured over a window of at least one renew interval once renewals run (statements by the pgx tracer, write transactions from `pg_current_snapshot()`, commits from `pg_stat_database`, which backends update lazily, so only roughly; CPU from getrusage of this process).\n\n")
		w("| leases held | TTL / renew every | acquiring took | statements/s sent | write xacts/s (xids) | xact_commit/s (approximate) | client CPU, %% of one core | client CPU µs / lease renewed | heap KiB / lease | leases lost | acquires failed | releasing all (%d goroutines) took | pool connections opened / closed while releasing |\n|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n", releaseGoroutines)
		for _, x := range r.Renewal {
			w("| %s of %s | %.0f s / %.0f s | %.1f s | %s | %s | %s | %.1f | %.1f | %.2f | %d | %d | %.1f s | %d / %d |\n", num(float64(x.Held)), num(float64(x.Leases)), x.TTLSeconds, x.RenewSeconds, x.AcquireSeconds,
				num(x.StatementsPerS), num(x.XIDsPerS), num(x.XactCommitsPerS), x.ClientCPUPct, x.CPUusPerRenewal, x.HeapKiBPerLease, x.Lost, x.AcquireFailed, x.ReleaseSeconds, x.NewConnsDuringRelease, x.ClosedConnsDuringRelease)
		}
		for _, x := range r.Renewal {
			if x.Lost == 0 && x.Held == x.Leases {
				continue
			}
			need := float64(x.Leases) / x.RenewSeconds
			w("\n%s leases with a %.0f s TTL need %s durable renewals per second.", num(float64(x.Leases)), x.TTLSeconds, num(need))
			if x.Held < x.Leases {
				w(" Only %s could be taken before the benchmark stopped acquiring (after %.1f s): the renewals of the leases already held use up the commits the acquires need.", num(float64(x.Held)), x.AcquireSeconds)
			}
			if x.Lost > 0 {
				w(" %d of the %s held were lost (a renewal did not get through before the local deadline); a lost Guard stops renewing, so the window then sees fewer statements.", x.Lost, num(float64(x.Held)))
			}
			if raw := r.rate("pg", "raw", 64); !math.IsNaN(raw) {
				w(" The database's commit rate is the limit: the raw pairs above commit about %s times per second at 64 goroutines.", num(2*raw))
			}
			w("\n")
		}
		for _, x := range r.Renewal {
			if x.ClosedConnsDuringRelease > 0 {
				w("\nWhile %s leases were released, the pool closed %d connections: consistent with a renewal cancelled in flight, which costs pgx its connection (it closes a connection whose query was cancelled).\n", num(float64(x.Held)), x.ClosedConnsDuringRelease)
				break
			}
		}
	}
	if len(r.BatchRenew) > 0 {
		w("\nFor scale, one statement renewing many leases at once (`UPDATE … FROM unnest($keys, $tokens)`, the floor under the client's batch renewals; measured on the raw table):\n\n| leases in one statement | median ms | WAL bytes / lease |\n|--:|--:|--:|\n")
		for _, b := range r.BatchRenew {
			w("| %s | %.1f | %.0f |\n", num(float64(b.Leases)), b.MedianMs, b.WALBytesPerLease)
		}
	}
	if gs := r.concs("groupcommit"); len(gs) > 0 {
		w("\n## Client-side group commit\n\nThe raw durable pair (acquire upsert + release, one statement and one commit each) beside the same statements coalesced across goroutines (acquires, and releases, that arrive while %d statements of their kind are in flight go together in the next one, keys in key order: the best a client could do, with no validation and no Guards), and ashlock's Backend with its group commit (the default: the same rule with 4 statements in flight, one unnest statement per batch, a batch of one sent with the single statement) and without it (`DisableGroupCommit`), each with its default asynchronous release and with `DurableRelease`. Target: the Backend with group commit ≥ 1.5× the raw durable pair at 64 goroutines.\n\n| contender | %s |\n|---|%s\n", coalescers, cols(gs, "", false), strings.Repeat("--:|", len(gs)))
		for _, c := range []string{"raw", "raw-coalesced", "backend", "backend-durable", "backend-nogc", "backend-durable-nogc"} {
			if _, ok := r.cell("groupcommit", c, gs[0]); !ok {
				continue // an older run without it
			}
			w("| %s |", name("groupcommit", c))
			for _, g := range gs {
				cell, _ := r.cell("groupcommit", c, g)
				if c == "raw" {
					w(" %s |", num(cell.OpsPerSec))
				} else {
					w(" %s (%s) |", num(cell.OpsPerSec), ratioStr(r.ratio("groupcommit", c, "raw", g)))
				}
			}
			w("\n")
		}
	}
	r.multiKeyMarkdown(w)
	if gs := r.concs("sqlite"); len(gs) > 0 {
		w("\n## SQLite: acquire + release pairs/s\n\n| contender | %s | p50 at 1 (ms) |\n|---|%s--:|\n", cols(gs, "", false), strings.Repeat("--:|", len(gs)))
		for _, c := range []string{"raw-FULL", "ashlock-FULL", "raw-NORMAL", "ashlock-NORMAL", "flock"} {
			w("| %s |", name("sqlite", c))
			var first Cell
			for i, g := range gs {
				cell, _ := r.cell("sqlite", c, g)
				if i == 0 {
					first = cell
				}
				switch c {
				case "ashlock-FULL":
					w(" %s (%s) |", num(cell.OpsPerSec), ratioStr(r.ratio("sqlite", c, "raw-FULL", g)))
				case "ashlock-NORMAL":
					w(" %s (%s) |", num(cell.OpsPerSec), ratioStr(r.ratio("sqlite", c, "raw-NORMAL", g)))
				default:
					w(" %s |", num(cell.OpsPerSec))
				}
			}
			w(" %s |\n", msStr(first.P50us))
		}
		w("\nIn parentheses: the ratio to the raw statements at the same synchronous level, same rounds (target ≥ 0.9×). All goroutines share the process's one connection.")
		if len(r.SQLiteBusyRetries) > 0 {
			w(" Busy retries by the ashlock backends during the section: FULL %d, NORMAL %d.", r.SQLiteBusyRetries["ashlock-FULL"], r.SQLiteBusyRetries["ashlock-NORMAL"])
		}
		w("\n")
	}
	if gs := r.concs("memory"); len(gs) > 0 {
		w("\n## Memory: acquire + release pairs/s\n\n| contender | %s | allocs / pair at 1 |\n|---|%s--:|\n", cols(gs, "", false), strings.Repeat("--:|", len(gs)))
		for _, c := range []string{"mutex-map", "ashlock-memory", "ashlock-memory-client"} {
			if _, ok := r.cell("memory", c, gs[0]); !ok {
				continue
			}
			w("| %s |", name("memory", c))
			var first Cell
			for i, g := range gs {
				cell, _ := r.cell("memory", c, g)
				if i == 0 {
					first = cell
				}
				if c != "mutex-map" {
					w(" %s (%s) |", num(cell.OpsPerSec), ratioStr(r.ratio("memory", c, "mutex-map", g)))
				} else {
					w(" %s |", num(cell.OpsPerSec))
				}
			}
			w(" %s |\n", ptr(first.AllocsPerOp, "%.2f"))
		}
		w("\nTargets on one goroutine: the Backend ≥ 1M pairs/s with ≤ 2 allocs per pair; Client + Guard ≥ 1M pairs/s with ≤ 4 allocs per pair.\n")
	}
	if gs := r.concs("etcd"); len(gs) > 0 {
		r.etcdMarkdown(w, gs)
	}
	if gs := r.concs("mariadb"); len(gs) > 0 {
		r.mariadbMarkdown(w, gs)
	}
	if r.Redis != nil {
		r.redisMarkdown(w)
	}
	var errs []string
	for _, c := range r.Cells {
		if c.Errors > 0 {
			errs = append(errs, fmt.Sprintf("%s/%s/%d: %d errors, first: %s", c.Section, c.Contender, c.Goroutines, c.Errors, c.FirstError))
		}
	}
	if len(errs) > 0 {
		w("\n## Errors during the run\n\n")
		for _, e := range errs {
			w("- %s\n", e)
		}
	}
	return b.String()
}

// EtcdResult is what the etcd section measures beyond its matrix.
type EtcdResult struct {
	Version  string    `json:"version"`
	Members  int       `json:"members,omitempty"`  // of the throwaway cluster; 0 in reports before it was recorded: one
	External bool      `json:"external,omitempty"` // a cluster given by -etcd-endpoints
	Handoff  []Latency `json:"handoff"`
}

func (r *Report) etcdMarkdown(w func(string, ...any), gs []int) {
	version, members := "?", "One etcd %s member started from the machine's binary"
	if r.Etcd != nil {
		version = r.Etcd.Version
		switch {
		case r.Etcd.External:
			members = "An etcd %s cluster given by -etcd-endpoints, the clients given all of them"
		case r.Etcd.Members == 3:
			members = "Three etcd %s members started from the machine's binary, the clients given all three endpoints"
		}
	}
	w("\n## etcd: TryAcquire + Release pairs/s\n\n"+members, version)
	w(" (data directory on the temp file system, etcd's default durable settings), random keys; etcd's `concurrency.Mutex` does TryLock + Unlock with one session per goroutine (its lease granted once, before the cell, and kept alive in the background), where each ashlock lease has a TTL and an etcd lease of its own (a spare one, granted ahead or left by a release, renewed by a keep-alive sent together with the grant's transaction), so an ashlock pair costs one request more (a keep-alive, a transaction and a release transaction against a transaction and a delete), and no round trip more.\n\n| contender | %s |\n|---|%s\n", cols(gs, "", false), strings.Repeat("--:|", len(gs)))
	for _, c := range []string{"mutex", "backend", "client"} {
		w("| %s |", name("etcd", c))
		for _, g := range gs {
			cell, _ := r.cell("etcd", c, g)
			if c == "mutex" {
				w(" %s |", num(cell.OpsPerSec))
			} else {
				w(" %s (%s) |", num(cell.OpsPerSec), ratioStr(r.ratio("etcd", c, "mutex", g)))
			}
		}
		w("\n")
	}
	w("\nIn parentheses: the ratio to `concurrency.Mutex`, same rounds (target ≥ 1×). p50 latency of a pair at 1 goroutine: mutex %s ms, Backend %s ms.\n",
		msStr(findCellIn(r.Cells, "etcd", "mutex", gs[0]).P50us), msStr(findCellIn(r.Cells, "etcd", "backend", gs[0]).P50us))
	r.etcdCostMarkdown(w, gs)
	if r.Etcd != nil && len(r.Etcd.Handoff) > 0 {
		w("\n| etcd handoff (release → a waiting Acquire / Lock holds) | n | p50 ms | p90 ms | p99 ms | max ms |\n|---|--:|--:|--:|--:|--:|\n")
		for _, l := range r.Etcd.Handoff {
			w("| %s | %d | %.2f | %.2f | %.2f | %.2f |\n", l.Name, l.N, l.P50ms, l.P90ms, l.P99ms, l.MaxMs)
		}
	}
}

// etcdCostMarkdown is the etcd section's table of what one pair costs,
// from the cells' cost counters (etcdProbe); nothing when none was read.
func (r *Report) etcdCostMarkdown(w func(string, ...any), gs []int) {
	cols := []struct{ key, head, format string }{
		{"requests", "requests", "%.2f"},
		{"raft_entries", "raft entries", "%.2f"},
		{"wal_fsyncs", "WAL fsyncs", "%.2f"},
		{"key_writes", "key writes", "%.2f"},
		{"client_cpu_us", "client CPU µs", "%.0f"},
		{"etcd_cpu_us", "etcd CPU µs", "%.0f"},
	}
	header := false
	for _, g := range gs {
		for _, c := range []string{"mutex", "backend", "client"} {
			cell := findCellIn(r.Cells, "etcd", c, g)
			if len(cell.CostPerOp) != len(cols) {
				continue
			}
			if !header {
				w("\nWhat one pair costs, medians over rounds: the requests the etcd members received (a unary call or one message on a stream: a keep-alive, a watch request; summed over members), the raft entries committed, WAL fsyncs and key writes (puts and deletes; of the member with the most), and CPU per pair in this process (the contender's client) and in the members (summed). On two cores shared by both, throughput follows the sum of the two CPU columns once the cores are busy.\n\n| contender | goroutines |")
				for _, col := range cols {
					w(" %s |", col.head)
				}
				w("\n|---|--:|%s\n", strings.Repeat("--:|", len(cols)))
				header = true
			}
			w("| %s | %d |", name("etcd", c), g)
			for _, col := range cols {
				w(" "+col.format+" |", cell.CostPerOp[col.key])
			}
			w("\n")
		}
	}
}

// findCellIn is findCell within one section.
func findCellIn(cells []Cell, section, contender string, g int) Cell {
	for _, c := range cells {
		if c.Section == section && c.Contender == contender && c.Goroutines == g {
			return c
		}
	}
	return Cell{}
}

func shortName(c string) string {
	switch c {
	case "raw":
		return "raw (durable)"
	case "raw-async":
		return "raw (async release)"
	case "backend":
		return "ashlock Backend"
	case "backend-durable":
		return "ashlock Backend (DurableRelease)"
	case "backend-nonotify":
		return "ashlock Backend (DisableNotify)"
	case "backend-sqldb-pgx":
		return "ashlock Backend on *sql.DB (pgx stdlib)"
	case "backend-sqldb-pq":
		return "ashlock Backend on *sql.DB (lib/pq)"
	case "backend-sqldb-pq-unnamed":
		return "ashlock Backend on *sql.DB (lib/pq, unnamed)"
	case "client":
		return "ashlock Client"
	case "pglock":
		return "pglock"
	case "advisory":
		return "advisory"
	}
	return c
}

// cols is a header row's cells for the concurrencies: "1 goroutine | 4
// goroutines" with suffix appended to each, or bare numbers with bare set.
func cols(gs []int, suffix string, bare bool) string {
	var parts []string
	for _, g := range gs {
		if bare {
			parts = append(parts, fmt.Sprint(g))
		} else {
			parts = append(parts, fmt.Sprintf("%d goroutine%s%s", g, plural(g), suffix))
		}
	}
	return strings.Join(parts, " | ")
}

func plural(n int) string {
	if n == 1 {
		return ""
	}
	return "s"
}

func orDash(s string) string {
	if s == "" {
		return "–"
	}
	return s
}

func concsOf(cells []Cell) []int {
	var gs []int
	for _, c := range cells {
		if !slices.Contains(gs, c.Goroutines) {
			gs = append(gs, c.Goroutines)
		}
	}
	slices.Sort(gs)
	return gs
}

func findCell(cells []Cell, contender string, g int) Cell {
	for _, c := range cells {
		if c.Contender == contender && c.Goroutines == g {
			return c
		}
	}
	return Cell{OpsPerSec: math.NaN()}
}
