package main

import (
	"bufio"
	"context"
	"database/sql"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strings"
	"syscall"
	"time"
)

// Env describes where and with what the figures were measured.
type Env struct {
	CPUs          int               `json:"cpus"`
	CPUModel      string            `json:"cpu_model"`
	MemoryGiB     float64           `json:"memory_gib"`
	Kernel        string            `json:"kernel"`
	Go            string            `json:"go"`
	Modules       map[string]string `json:"modules"`
	PGVersion     string            `json:"postgres_version,omitempty"`
	PGSettings    map[string]string `json:"postgres_settings,omitempty"`
	PGDataDir     string            `json:"postgres_data_dir,omitempty"`
	SQLiteVersion string            `json:"sqlite_version"`
	TempFS        string            `json:"temp_filesystem"`
	// Fdatasyncs is how many 8 KiB write+fdatasync the temp directory's
	// file system does per second, one at a time: the durable-commit
	// ceiling of one client.
	Fdatasyncs float64 `json:"fdatasync_per_sec"`
}

var pgSettingNames = []string{"fsync", "synchronous_commit", "full_page_writes", "wal_sync_method", "wal_level",
	"commit_delay", "shared_buffers", "max_connections", "max_wal_size", "checkpoint_timeout", "autovacuum"}

func describeEnv(ctx context.Context, pe *pgEnv, tmp, pgDataDir string) Env {
	e := Env{CPUs: runtime.NumCPU(), Go: runtime.Version(), Modules: map[string]string{}, PGDataDir: pgDataDir}
	if f, err := os.Open("/proc/cpuinfo"); err == nil {
		s := bufio.NewScanner(f)
		for s.Scan() {
			if k, v, ok := strings.Cut(s.Text(), ":"); ok && strings.TrimSpace(k) == "model name" {
				e.CPUModel = strings.TrimSpace(v)
				break
			}
		}
		f.Close()
	}
	var si syscall.Sysinfo_t
	if syscall.Sysinfo(&si) == nil {
		e.MemoryGiB = float64(si.Totalram) * float64(si.Unit) / (1 << 30)
	}
	var u syscall.Utsname
	if syscall.Uname(&u) == nil {
		e.Kernel = cstr(u.Release[:])
	}
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, d := range bi.Deps {
			switch d.Path {
			case "cirello.io/pglock", "github.com/jackc/pgx/v5", "modernc.org/sqlite", "github.com/lib/pq", "gonum.org/v1/plot",
				"github.com/bsm/redislock", "github.com/go-redsync/redsync/v4", "github.com/redis/go-redis/v9":
				e.Modules[d.Path] = d.Version
			}
		}
	}
	if db, err := sql.Open("sqlite", filepath.Join(tmp, "version.db")); err == nil {
		_ = db.QueryRowContext(ctx, `SELECT sqlite_version()`).Scan(&e.SQLiteVersion)
		db.Close()
	}
	e.TempFS = fsName(tmp)
	e.Fdatasyncs = fdatasyncRate(tmp, time.Second)
	if pe != nil {
		pe.adminMu.Lock()
		defer pe.adminMu.Unlock()
		_ = pe.admin.QueryRow(ctx, `SHOW server_version`).Scan(&e.PGVersion)
		e.PGSettings = map[string]string{}
		for _, n := range pgSettingNames {
			var v string
			if pe.admin.QueryRow(ctx, `SELECT current_setting($1)`, n).Scan(&v) == nil {
				e.PGSettings[n] = v
			}
		}
	}
	return e
}

func cstr(b []int8) string {
	var sb strings.Builder
	for _, c := range b {
		if c == 0 {
			break
		}
		sb.WriteByte(byte(c))
	}
	return sb.String()
}

func fsName(dir string) string {
	var st syscall.Statfs_t
	if syscall.Statfs(dir, &st) != nil {
		return "unknown"
	}
	names := map[int64]string{0xEF53: "ext4", 0x58465342: "xfs", 0x01021994: "tmpfs", 0x794c7630: "overlayfs", 0x9123683E: "btrfs", 0x2fc12fc1: "zfs"}
	if n, ok := names[int64(st.Type)]; ok {
		return n
	}
	return fmt.Sprintf("0x%x", st.Type)
}

// fdatasyncRate writes 8 KiB at the start of a file and fdatasyncs it, one
// at a time, for d.
func fdatasyncRate(dir string, d time.Duration) float64 {
	f, err := os.CreateTemp(dir, "fsync-")
	if err != nil {
		return 0
	}
	defer os.Remove(f.Name())
	defer f.Close()
	buf := make([]byte, 8192)
	n := 0
	start := time.Now()
	for time.Since(start) < d {
		buf[n%len(buf)]++
		if _, err := f.WriteAt(buf, 0); err != nil {
			return 0
		}
		if err := syscall.Fdatasync(int(f.Fd())); err != nil {
			return 0
		}
		n++
	}
	return float64(n) / time.Since(start).Seconds()
}

func (e Env) summary() string {
	return fmt.Sprintf("%d CPUs (%s), %.1f GiB, Linux %s, %s; PostgreSQL %s; SQLite %s; temp dir on %s, %.0f fdatasync/s",
		e.CPUs, e.CPUModel, e.MemoryGiB, e.Kernel, e.Go, e.PGVersion, e.SQLiteVersion, e.TempFS, e.Fdatasyncs)
}
