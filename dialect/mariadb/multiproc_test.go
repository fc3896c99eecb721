package mariadb

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/testkit/mariatest"
	"github.com/ashlock/ashlock/sqllock"
)

// stormEnv, set, makes the test binary a storm child (see TestMain): its
// value is the child's stormConfig as JSON.
const stormEnv = "SQLLOCK_MARIADB_STORM_CHILD"

type stormConfig struct {
	DSN    string
	Rounds int
}

type stormReport struct {
	Sections int
	Stale    int // token-checked writes refused: must be 0
	Errors   []string
}

// stormChild takes the key Rounds times, each time writing the counter in
// a fenced transaction with a token check and recording its token (a
// primary key: a token granted twice fails the insert), and prints its
// report as JSON.
func stormChild() int {
	var cfg stormConfig
	if err := json.Unmarshal([]byte(os.Getenv(stormEnv)), &cfg); err != nil {
		fmt.Fprintln(os.Stderr, "storm child:", err)
		return 2
	}
	var rep stormReport
	err := func() error {
		db, err := sql.Open("mysql", cfg.DSN)
		if err != nil {
			return err
		}
		defer db.Close()
		b, err := New(db, Options{})
		if err != nil {
			return err
		}
		defer b.Close()
		c, err := sqllock.New(b, sqllock.Options{TTL: 2 * time.Second})
		if err != nil {
			return err
		}
		defer c.Close(context.Background())
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		for range cfg.Rounds {
			err := c.Do(ctx, "storm", &sqllock.AcquireOptions{Wait: sqllock.WaitForever}, func(ctx context.Context, g *sqllock.Guard) error {
				return b.FencedTx(ctx, g.Lease(), func(tx *sql.Tx) error {
					if _, err := tx.ExecContext(ctx, "INSERT INTO sections (token) VALUES (?)", g.Token()); err != nil {
						return err
					}
					res, err := tx.ExecContext(ctx, "UPDATE counter SET n = n + 1, last_token = ? WHERE id = 1 AND last_token < ?", g.Token(), g.Token())
					if err != nil {
						return err
					}
					if n, _ := res.RowsAffected(); n != 1 {
						rep.Stale++
					}
					return nil
				})
			})
			if err != nil {
				rep.Errors = append(rep.Errors, err.Error())
				continue
			}
			rep.Sections++
		}
		return nil
	}()
	if err != nil {
		rep.Errors = append(rep.Errors, err.Error())
	}
	data, _ := json.Marshal(rep)
	fmt.Println(string(data))
	return 0
}

// Processes of their own (the test binary, re-executed) take one key in
// turn and write a counter under it: no increment lost, no token granted
// twice, no stale write.
func TestStormProcesses(t *testing.T) {
	s := mariatest.Server(t)
	name := mariatest.Database(t, s)
	db := mariatest.Open(t, s.Addr, name)
	migrated(t, db, Options{})
	for _, q := range []string{
		"CREATE TABLE counter (id INT PRIMARY KEY, n INT NOT NULL, last_token BIGINT NOT NULL)",
		"INSERT INTO counter VALUES (1, 0, 0)",
		"CREATE TABLE sections (token BIGINT PRIMARY KEY)",
	} {
		_, err := db.ExecContext(testCtx(t), q)
		require.NoError(t, err)
	}
	const procs, rounds = 3, 20
	env, err := json.Marshal(stormConfig{DSN: mariatest.DSN(s.Addr, name), Rounds: rounds})
	require.NoError(t, err)
	cmds := make([]*exec.Cmd, procs)
	outs := make([]*[]byte, procs)
	for i := range cmds {
		cmd := exec.CommandContext(testCtx(t), os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), stormEnv+"="+string(env))
		cmd.Stderr = os.Stderr
		out := new([]byte)
		cmds[i], outs[i] = cmd, out
	}
	errs := make(chan error, procs)
	for i, cmd := range cmds {
		go func() {
			out, err := cmd.Output()
			*outs[i] = out
			errs <- err
		}()
	}
	for range cmds {
		require.NoError(t, <-errs)
	}
	total := 0
	for i, out := range outs {
		var rep stormReport
		require.NoError(t, json.Unmarshal(*out, &rep), "child %d: %s", i, *out)
		require.Empty(t, rep.Errors, "child %d", i)
		require.Zero(t, rep.Stale, "child %d: stale writes", i)
		total += rep.Sections
	}
	var n, sections int
	require.NoError(t, db.QueryRowContext(testCtx(t), "SELECT n FROM counter WHERE id = 1").Scan(&n))
	require.NoError(t, db.QueryRowContext(testCtx(t), "SELECT COUNT(*) FROM sections").Scan(&sections))
	t.Logf("storm: %d processes, %d sections, counter %d, distinct tokens %d", procs, total, n, sections)
	require.Equal(t, procs*rounds, total)
	require.Equal(t, total, n, "no increment lost")
	require.Equal(t, total, sections, "every section had a token of its own")
}
