package sqlident

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func TestValidate(t *testing.T) {
	t.Parallel()

	good := []string{
		"a", "_", "sqllock_locks", "Locks2", "_x_9", "UPPER",
		"a" + strings.Repeat("b", 62), // 63 chars, the maximum
	}
	for _, name := range good {
		require.NoError(t, Validate(name), "name %q", name)
	}

	bad := map[string]string{
		"Empty":     "",
		"TooLong":   "a" + strings.Repeat("b", 63), // 64 chars
		"Digit":     "1locks",
		"Quote":     `lo"cks`,
		"Apostroph": "lo'cks",
		"Semicolon": "x; drop",
		"Space":     "my locks",
		"Dot":       "public.locks",
		"Hyphen":    "my-locks",
		"Unicode":   "lockś",
		"NUL":       "locks\x00",
		"Newline":   "locks\n",
	}
	for name, value := range bad {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			err := Validate(value)
			require.Error(t, err)
			require.True(t, errors.Is(err, ErrInvalidIdentifier))
			require.Contains(t, err.Error(), fmt.Sprintf("%q", value))
		})
	}
}

// TestValidateTable: a lock table name leaves room for "_version".
func TestValidateTable(t *testing.T) {
	t.Parallel()
	require.NoError(t, ValidateTable("sqllock_locks"))
	require.NoError(t, ValidateTable(strings.Repeat("t", MaxTableLen)))
	require.NoError(t, Validate(strings.Repeat("t", MaxTableLen)+VersionSuffix))
	for _, name := range []string{strings.Repeat("t", MaxTableLen+1), strings.Repeat("t", MaxLen), "", "1x"} {
		err := ValidateTable(name)
		require.ErrorIs(t, err, ErrInvalidIdentifier, "%q", name)
	}
	require.ErrorContains(t, ValidateTable(strings.Repeat("t", 56)), "at most 55 bytes")
}

func TestQuotePostgres(t *testing.T) {
	t.Parallel()

	require.Equal(t, `"sqllock_locks"`, QuotePostgres("", "sqllock_locks"))
	require.Equal(t, `"app"."Locks"`, QuotePostgres("app", "Locks"))
	// Defence in depth: even unvalidated input cannot escape the quotes.
	require.Equal(t, `"a""b"`, QuotePostgres("", `a"b`))
}

func TestQuoteSQLite(t *testing.T) {
	t.Parallel()

	require.Equal(t, `"sqllock_locks"`, QuoteSQLite("sqllock_locks"))
	require.Equal(t, `"a""b"`, QuoteSQLite(`a"b`))
}
